#!/usr/bin/env bash
# A plain isolated `pip install .` (torch invisible to the build) must give a package that builds its
# extension just-in-time on first import and caches it. CPU-only here to keep the check short.
set -euo pipefail
cd "$(dirname "$0")/.."
target=$(mktemp -d)
cache=$(mktemp -d)
trap 'rm -rf "$target" "$cache"' EXIT
pip install -q --no-deps --target "$target" .
test ! -e "$target"/offload_ext/_C*.so || { echo "isolated build unexpectedly compiled the extension"; exit 1; }
compgen -G "$target/offload_ext-*.dist-info/licenses/LICENSE" >/dev/null || { echo "the wheel lacks LICENSE"; exit 1; }
run() {
  (cd "$target" && unset OFFLOAD_EXT_FORCE_CUDA && OFFLOAD_EXT_FORCE_CPU=1 TORCH_EXTENSIONS_DIR="$cache" PYTHONPATH="$target" python - <<'PY'
import torch, offload_ext
info = offload_ext.build_info()
assert info["native"] and info["native_origin"] == "just-in-time", info
p, g = torch.randn(1000), torch.randn(1000)
m, v = torch.zeros(1000), torch.zeros(1000)
offload_ext.adamw_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
assert torch.isfinite(p).all()
print("isolated install OK:", info["native_origin"], "simd", info["simd"])
PY
  )
}
t0=$SECONDS; run; echo "first import (builds): $((SECONDS - t0)) s"
t0=$SECONDS; run; echo "second import (cached): $((SECONDS - t0)) s"
