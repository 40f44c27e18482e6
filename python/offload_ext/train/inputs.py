"""offload-train's inputs checked before anything is read, allocated or written: the numeric flags, and
every --model / --tokenizer / --dataset that names a local path or a hub id. Each problem is one UsageError
naming the input, what was expected and the fix."""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import functools
import json
import math
import os
import re
import socket
from urllib.parse import urlparse

from offload_ext.config import parse_size
from offload_ext.models.safetensors_io import checkpoint_entries
from offload_ext.train.data import EMBEDDED
from offload_ext.train.errors import UsageError
from offload_ext.train.model_configs import BUILTIN

# flag's attribute: (least value, what one unit is). None (a default not yet applied) is not checked.
_WHOLE_NUMBERS = {
    "batch_size": (1, "sequences per micro-batch"), "seq_len": (1, "tokens per sequence"),
    "grad_accum": (1, "micro-batches per step"), "steps": (1, "optimizer steps"),
    "warmup_steps": (0, "steps"), "resident_layers": (0, "layers"), "device_layers": (2, "layer buffers"),
    "save_every": (0, "steps; 0: only at the end"), "log_every": (1, "steps"), "loss_chunk_tokens": (1, "tokens"),
    "stop_after": (1, "steps"), "lora_r": (1, "the adapters' rank"), "seed": (0, "numpy takes 0 to 2**32 - 1"),
    "keep_checkpoints": (1, "complete checkpoints kept"),
}
# flag's attribute: (whether 0 is allowed, an example)
_REAL_NUMBERS = {"lr": (False, "3e-4"), "weight_decay": (True, "0.1"), "max_grad_norm": (False, "1.0"),
                 "lora_alpha": (False, "16")}
_SEED_END = 2**32  # numpy's seed() refuses anything from here on

DATA_FILE_TYPES = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_OFFLINE_VALUES = {"1", "on", "yes", "true"}  # huggingface_hub's own reading of HF_HUB_OFFLINE
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag in its range: a zero batch or a negative learning rate otherwise fails deep inside
    torch with a traceback (a ZeroDivisionError, an optimizer's ValueError)."""
    if args.base_dtype is not None and args.lora_r is None:
        raise UsageError(f"--base-dtype {args.base_dtype} quantizes the frozen base of a LoRA run: add --lora-r R "
                         "(a full fine-tune trains every weight, and trained weights stay in --precision)")
    for name, (least, unit) in _WHOLE_NUMBERS.items():
        value = getattr(args, name, None)
        if value is not None and value != "auto" and value < least:
            raise UsageError(f"{_flag(name)} must be at least {least} ({unit}), got {value}")
    if args.seed >= _SEED_END:
        raise UsageError(f"--seed must be below 2**32 ({_SEED_END}), got {args.seed}")
    for name, (zero_ok, example) in _REAL_NUMBERS.items():
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
            expected = "a finite number of at least 0" if zero_ok else "a finite number above 0"
            raise UsageError(f"{_flag(name)} must be {expected} (e.g. {example}), got {value}")
    for name in ("gpu_memory", "host_memory", "gpu_memory_budget"):
        value = getattr(args, name, None)
        if value is not None:
            try:
                parse_size(value)
            except ValueError as exc:
                raise UsageError(f"{_flag(name)}: {exc}") from exc
    checkpointing = args.activation_checkpointing
    if not isinstance(checkpointing, int) and checkpointing not in ("all", "none", "auto"):
        raise UsageError(f"--activation-checkpointing {checkpointing}: expected all, none, auto or a number of "
                         "layers")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_inputs(args: argparse.Namespace) -> None:
    """--model, --tokenizer and --dataset: a local path that is there and readable, or a hub id the hub can
    be asked for. A path that does not exist is never sent to the hub (its retries took 49 s)."""
    _check_out_is_writable(args.out)
    if (args.model in BUILTIN or args.model == "auto") and args.pretrained:
        raise UsageError(f"--pretrained: built-in config {args.model!r} has no weights; use --from-scratch, or "
                         "--model DIR or a hub id with weights")
    if args.model not in BUILTIN and args.model != "auto":
        _check_model(args.model, weights_read=args.pretrained is not False)  # None: the directory decides
    if args.tokenizer is not None:
        _check_source("--tokenizer", args.tokenizer, expected="a tokenizer directory, a tokenizer.json or a hub id")
    if args.dataset != EMBEDDED and not args.dry_run:  # a dry run reads no data
        _check_dataset(args)


def _check_out_is_writable(out: str) -> None:
    """--out is a directory, or can be made: its nearest existing ancestor is a directory this user may write."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out}: a file is there; expected a directory (made when missing): pass another --out")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--out {out}: {parent} is a file, not a directory; pass another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: permission denied to write in {parent}; pass an --out this user can write")


def looks_like_a_path(name: str) -> bool:
    """Whether `name` can only be a local path: it starts with '.', '~' or '/', ends in a data file's
    extension, has more than one '/', holds a character no hub id has, or starts with a directory that is
    here (`models/x` when ./models exists). `org/name` otherwise may be a hub id."""
    if name.startswith((".", "~", "/", os.sep)) or name.lower().endswith((*DATA_FILE_TYPES, ".safetensors")):
        return True
    if not _HUB_ID.match(name):
        return True
    head = name.split("/", 1)[0]
    return "/" in name and os.path.isdir(head)


def _check_source(flag: str, name: str, expected: str) -> str | None:
    """The local path `name` stands for (None: a hub id). Refuses a path that is not there, and a hub id
    when the hub cannot be reached."""
    path = os.path.expanduser(name)
    if os.path.exists(path):
        if not os.access(path, os.R_OK):
            raise UsageError(f"{flag} {name}: permission denied; expected {expected} this user can read")
        return path
    if looks_like_a_path(name):
        raise UsageError(f"{flag} {name}: no such file or directory; expected {expected} (check the path)")
    _check_hub(flag, name, expected)
    return None


def _check_hub(flag: str, name: str, expected: str) -> None:
    if _hub_offline() or _hub_reachable():
        return  # offline mode: the libraries read their cache and say themselves what is missing
    raise UsageError(f"{flag} {name}: no such file or directory, and the Hugging Face hub ({_hub_host()[0]}) cannot "
                     f"be reached to fetch it as a hub id; expected {expected}: check the path, connect, or set "
                     "HF_HUB_OFFLINE=1 to use a copy already in the hub's cache")


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _OFFLINE_VALUES
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_host() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.cache
def _hub_reachable(timeout: float = 5.0) -> bool:
    """Whether a TCP connection to the hub opens within `timeout` seconds (a proxy's rules cannot be known
    from here: with one set, the libraries are left to try). The name lookup runs on a thread because the
    resolver does not honour socket timeouts."""
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return True
    host, port = _hub_host()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(lambda: socket.create_connection((host, port), timeout=timeout).close()).result(timeout)
        return True
    except (OSError, concurrent.futures.TimeoutError):
        return False
    finally:
        pool.shutdown(wait=False)


def _check_model(name: str, weights_read: bool) -> None:
    path = _check_source("--model", name, expected="a built-in config (" + ", ".join(BUILTIN) + "), a model "
                         "directory or a hub id")
    if path is None:
        return
    if not os.path.isdir(path):
        raise UsageError(f"--model {name}: not a directory; expected a model directory (config.json and weights, as "
                         "save_pretrained writes it) or a built-in config (" + ", ".join(BUILTIN) + ")")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--model {name}: the directory has no config.json; expected a transformers model directory "
                         "(save_pretrained writes one)")
    if weights_read:
        try:
            checkpoint_entries(path)  # every header checked: a copy cut short fails here, not filling the engine
        except FileNotFoundError:
            pass  # no safetensors: --backend none loads what transformers finds; the engine names the fix
        except ValueError as exc:
            raise UsageError(f"--model {name}: {exc}") from exc


def _check_dataset(args: argparse.Namespace) -> None:
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        raise UsageError(f"--dataset {args.dataset}: reading a dataset needs the `datasets` package; "
                         "pip install datasets (or offload_ext[train])")
    path = _check_source("--dataset", args.dataset, expected="a data file (" + ", ".join(DATA_FILE_TYPES)
                         + "), a dataset directory or a hub id")
    if path is None:
        return
    if os.path.isdir(path):
        if not any(files for _, _, files in os.walk(path)):
            raise UsageError(f"--dataset {args.dataset}: the directory has no files; expected data files ("
                             + ", ".join(DATA_FILE_TYPES) + ") or a dataset repository's files")
        return
    check_data_file(args.dataset, path, args.text_field)


def check_data_file(name: str, path: str, text_field: str) -> None:
    """A data file has a known type, at least one row, and the --text-field column (what the file's first
    row or header says; a `datasets` read would have failed on the empty file with a traceback)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_FILE_TYPES:
        raise UsageError(f"--dataset {name}: unknown file type {ext or '(no extension)'}; expected "
                         + ", ".join(DATA_FILE_TYPES) + " (rename it, or convert it)")
    if ext == ".parquet":
        return _check_parquet(name, path, text_field)
    first = _first_line(path)
    if first is None:
        raise UsageError(f"--dataset {name}: the file is empty; expected {_ROWS[ext]}")
    if ext == ".txt":
        columns = ["text"]
    elif ext == ".csv":
        columns = next(csv.reader([first]))
        if _first_line(path, skip=1) is None:
            raise UsageError(f"--dataset {name}: the file has a header and no rows; expected {_ROWS[ext]}")
    elif first.lstrip().startswith("["):  # a .json holding one array: read by `datasets` itself
        return None
    else:
        try:
            row = json.loads(first)
        except ValueError as exc:
            raise UsageError(f"--dataset {name}: the first line is not JSON ({exc}); expected {_ROWS[ext]}") from exc
        if not isinstance(row, dict):
            raise UsageError(f"--dataset {name}: the first line is not a JSON object; expected {_ROWS[ext]}")
        columns = list(row)
    if text_field not in columns:
        raise UsageError(f"--text-field {text_field!r} is not a column of {name}; its columns are {columns} "
                         "(pass --text-field NAME)")
    return None


_ROWS = {".txt": "one document a line", ".csv": "a header and one row a line",
         ".jsonl": 'one JSON object a line, e.g. {"text": "..."}', ".json": 'JSON objects, e.g. {"text": "..."}'}


def _first_line(path: str, skip: int = 0) -> str | None:
    """The file's first non-blank line after `skip` of them (None: there is none)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                if skip == 0:
                    return line
                skip -= 1
    return None


def _check_parquet(name: str, path: str, text_field: str) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # `datasets` needs pyarrow: then it reports the file itself
        return
    try:
        meta = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's errors have no common base but ArrowException, itself not always there
        raise UsageError(f"--dataset {name}: not a readable parquet file ({exc}); write it again") from exc
    if meta.metadata.num_rows == 0:
        raise UsageError(f"--dataset {name}: the file has no rows; expected a table with a {text_field!r} column")
    columns = meta.schema_arrow.names
    if text_field not in columns:
        raise UsageError(f"--text-field {text_field!r} is not a column of {name}; its columns are {columns} "
                         "(pass --text-field NAME)")
