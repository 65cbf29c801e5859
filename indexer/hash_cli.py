"""``kvrouter hash``: vLLM block hashes of a prompt, for machines and for operators.

``--jsonl`` is the machine contract (the README's command table): each stdin line carries the
input fields of a golden hash vector (``vllm_version, hash_algo, pythonhashseed,
block_size, token_ids, lora, cache_salt, mm``) and gets one line
``{"block_hashes_hex": [...], "block_hashes_int64": [...]}``; a bad line gets
``{"error": ...}`` and the command goes on.

Without ``--jsonl`` it is for a person chasing a hash mismatch: hash ``--text`` (tokenized
like a completions prompt) or ``--token-ids`` with a model's settings from the fleet
config (``--model-config``), or with ``--algo/--block-size/--seed/--vllm-version``, and
print a table of block index, digest and the 64-bit key events carry.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

import msgspec
from rich.console import Console
from rich.table import Table

from indexer.hashing import ALGOS, BlockHasher, HashConfigError, to_int64


class LoraSpec(msgspec.Struct):
    """Fields a version does not hash may be left out; one it hashes is then a clear error."""

    name: str
    path: str | None = None
    int_id: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class MMItem(msgspec.Struct):
    identifier: str
    offset: int
    length: int


class HashLine(msgspec.Struct):
    """One ``--jsonl`` input line; other fields (a golden vector's expected output) are ignored."""

    vllm_version: str
    hash_algo: str
    pythonhashseed: str | int | None
    block_size: int
    token_ids: list[int]
    lora: LoraSpec | None = None
    cache_salt: str | None = None
    mm: list[MMItem] = []


_line_decoder = msgspec.json.Decoder(HashLine)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Compute vLLM prefix-cache block hashes: JSON lines for machines, a table for operators."
    parser.add_argument(
        "--jsonl", action="store_true", help="stdin lines shaped like golden hash vectors -> JSON lines"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", help="prompt text, tokenized like a completions prompt (special tokens added)")
    source.add_argument("--token-ids", help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--model-config", metavar="FILE", help="fleet config to take the model's hashing settings from")
    parser.add_argument("--model", help="model (or LoRA adapter) name in --model-config; default: its only model")
    parser.add_argument("--tokenizer", help="tokenizer path or hub id for --text without --model-config")
    parser.add_argument("--algo", choices=ALGOS, help="--prefix-caching-hash-algo of the engines (default sha256)")
    parser.add_argument("--block-size", type=int, help="engines' block size (default 16)")
    parser.add_argument("--seed", help="engines' PYTHONHASHSEED; leave out when it is unset there")
    parser.add_argument("--vllm-version", help="engines' vLLM version (default 0.33.0)")
    parser.add_argument("--cache-salt", help="the request's cache_salt")


def run(args: argparse.Namespace) -> int:
    if args.jsonl:
        return hash_jsonl(sys.stdin, sys.stdout)
    console = Console()
    try:
        return _hash_for_operator(console, args)
    except (HashConfigError, ValueError, OSError) as e:
        Console(stderr=True).print(f"[red]kvrouter hash:[/red] {e}")
        return 2


# -- JSONL contract ----------------------------------------------------------------------


def hash_line(line: str) -> dict[str, Any]:
    """The output object for one input line: the hashes, or ``{"error": ...}``."""
    try:
        req = _line_decoder.decode(line)
    except msgspec.DecodeError as e:
        return {"error": f"bad input line: {e}"}
    try:
        hasher = BlockHasher(req.hash_algo, req.block_size, req.pythonhashseed, req.vllm_version)
        digests = hasher.hash_blocks(
            req.token_ids,
            lora=req.lora.as_dict() if req.lora else None,
            cache_salt=req.cache_salt,
            mm=[msgspec.structs.asdict(item) for item in req.mm],
        )
    except (HashConfigError, ValueError) as e:
        return {"error": str(e)}
    return {"block_hashes_hex": [d.hex() for d in digests], "block_hashes_int64": [to_int64(d) for d in digests]}


def hash_jsonl(stdin: TextIO, stdout: TextIO) -> int:
    """One output line per non-blank input line; bad lines become error objects."""
    for line in stdin:
        if not line.strip():
            continue
        stdout.write(json.dumps(hash_line(line)) + "\n")
        stdout.flush()
    return 0


# -- operator mode -----------------------------------------------------------------------


def _hash_for_operator(console: Console, args: argparse.Namespace) -> int:
    if args.text is None and args.token_ids is None:
        raise ValueError("give --text or --token-ids (or --jsonl to read JSON lines from stdin)")
    settings: dict[str, Any] = {"algo": "sha256", "block_size": 16, "seed": None, "vllm_version": "0.33.0"}
    tokenizer, lora = args.tokenizer, None
    if args.model_config:
        model, lora = _model_from_config(args.model_config, args.model)
        settings = {"algo": model.hash_algo, "block_size": model.block_size, "seed": model.hash_seed,
                    "vllm_version": model.vllm_version}
        tokenizer = tokenizer or model.tokenizer
    overrides = {"algo": args.algo, "block_size": args.block_size, "seed": args.seed, "vllm_version": args.vllm_version}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    hasher = BlockHasher(**settings)
    token_ids = _parse_token_ids(args.token_ids) if args.token_ids is not None else _tokenize(tokenizer, args.text)
    digests = hasher.hash_blocks(token_ids, lora=lora, cache_salt=args.cache_salt)

    seed = "unset" if hasher.seed is None else repr(hasher.seed)
    console.print(
        f"vLLM {hasher.vllm_version} (dialect {hasher.dialect.name}), {hasher.algo}, block size "
        f"{hasher.block_size}, PYTHONHASHSEED {seed}\nNONE_HASH {hasher.none_hash.hex()}\n"
        f"{len(token_ids)} tokens -> {len(digests)} full blocks"
        + (f", LoRA {lora['name']}" if lora else "") + (f", cache_salt {args.cache_salt!r}" if args.cache_salt else "")
    )
    table = Table("block", "tokens")
    table.add_column("digest (hex)", overflow="fold")
    table.add_column("int64 (events)", no_wrap=True)
    for i, d in enumerate(digests):
        table.add_row(str(i), f"{i * hasher.block_size}-{(i + 1) * hasher.block_size - 1}", d.hex(), str(to_int64(d)))
    console.print(table)
    return 0


def _model_from_config(path: str, name: str | None) -> tuple[Any, dict[str, Any] | None]:
    """The base model serving ``name`` and, when ``name`` is an adapter, its LoRA key."""
    from kvconfig import ConfigError, load_config

    try:
        config = load_config(path)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if name is None:
        if len(config.models) != 1:
            raise ValueError(f"{path} has {len(config.models)} models; pick one with --model")
        return config.models[0], None
    model = config.model(name)
    if model is None:
        names = [m.name for m in config.models] + [a.name for m in config.models for a in m.lora_adapters]
        raise ValueError(f"no model or adapter {name!r} in {path}; known: {', '.join(names)}")
    adapter = next((a for a in model.lora_adapters if a.name == name), None)
    lora = None if adapter is None else {"name": adapter.name, "path": adapter.path, "int_id": adapter.id}
    return model, lora


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def _tokenize(tokenizer: str | None, text: str) -> list[int]:
    """Token ids of a completions prompt: vLLM adds special tokens (BOS) there."""
    if tokenizer is None:
        raise ValueError("--text needs a tokenizer: give --model-config or --tokenizer")
    from transformers import AutoTokenizer

    local = Path(tokenizer).exists()
    try:
        hf = AutoTokenizer.from_pretrained(tokenizer, local_files_only=local)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        raise ValueError(f"cannot load tokenizer {tokenizer!r}: {e}") from None
    return list(hf(text, add_special_tokens=True)["input_ids"])
