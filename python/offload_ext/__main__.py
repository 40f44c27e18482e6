"""`python -m offload_ext` / `offload-ext-info`: print build_info()."""
from __future__ import annotations

import json

from offload_ext import build_info


def main() -> None:
    print(json.dumps(build_info(), indent=2))


if __name__ == "__main__":
    main()
