"""``kvrouter hash`` run as a real process: the JSONL contract on every golden vector, and operator mode."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from indexer.hashing import BlockHasher, to_int64
from support import GOLDEN, KVROUTER, QWEN3_DIR, REPO

INPUT_FIELDS = ("vllm_version", "hash_algo", "pythonhashseed", "block_size", "token_ids", "lora", "cache_salt", "mm")
VECTORS = [json.loads(line) for f in sorted(GOLDEN.glob("hash_vectors_*.jsonl")) for line in f.read_text().splitlines()
           if line.strip()]


def kvrouter_hash(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*KVROUTER, "hash", *args], input=stdin, capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)


def test_jsonl_reproduces_every_golden_vector() -> None:
    lines = [json.dumps({k: v[k] for k in INPUT_FIELDS}) for v in VECTORS]
    proc = kvrouter_hash(["--jsonl"], "\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == len(VECTORS) == 574
    for vec, got in zip(VECTORS, out):
        assert got == {"block_hashes_hex": vec["block_hashes_hex"], "block_hashes_int64": vec["block_hashes_int64"]}, (
            vec["vllm_version"], vec["case"], vec["hash_algo"], vec["pythonhashseed"])


def test_jsonl_bad_lines_get_an_error_and_the_command_goes_on() -> None:
    good = json.dumps({k: VECTORS[2][k] for k in INPUT_FIELDS})
    bad = [
        "not json",
        json.dumps({"hash_algo": "sha256"}),
        json.dumps({**json.loads(good), "token_ids": [1, "2"]}),
        json.dumps({**json.loads(good), "hash_algo": "md5"}),
        json.dumps({**json.loads(good), "vllm_version": "0.28.0", "pythonhashseed": None}),
        json.dumps({**json.loads(good), "mm": [{"identifier": "x", "offset": -3, "length": 1}]}),
        json.dumps({**json.loads(good), "lora": {"name": "only-a-name"}}),
    ]
    proc = kvrouter_hash(["--jsonl"], "\n".join([*bad, "", good]) + "\n")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == len(bad) + 1
    assert all(set(o) == {"error"} and o["error"] for o in out[:-1])
    assert "PYTHONHASHSEED=0" in out[4]["error"]
    assert out[-1]["block_hashes_hex"] == VECTORS[2]["block_hashes_hex"]


def test_operator_mode_prints_every_block_of_token_ids() -> None:
    ids = list(range(1000, 1040))
    proc = kvrouter_hash(["--token-ids", ",".join(map(str, ids)), "--algo", "xxhash", "--seed", "42",
                          "--vllm-version", "0.22.0", "--block-size", "8"])
    assert proc.returncode == 0, proc.stderr
    digests = BlockHasher("xxhash", 8, "42", "0.22.0").hash_blocks(ids)
    assert len(digests) == 5
    for d in digests:
        assert d.hex() in proc.stdout and str(to_int64(d)) in proc.stdout


def test_operator_mode_tokenizes_text_with_the_configured_model(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    config = tmp_path / "fleet.yaml"
    config.write_text(
        "models:\n"
        f"  - {{name: qwen3, tokenizer: '{QWEN3_DIR}', block_size: 4, hash_algo: sha256_cbor, hash_seed: 0,\n"
        "      vllm_version: '0.33.0', lora_adapters: [{name: sql, path: /adapters/sql, id: 7}],\n"
        "      backends: [{name: a, url: 'http://127.0.0.1:9'}]}\n"
    )
    text = "The router hashes the same token ids the engine will hash."
    proc = kvrouter_hash(["--model-config", str(config), "--model", "sql", "--text", text])
    assert proc.returncode == 0, proc.stderr
    ids = AutoTokenizer.from_pretrained(str(QWEN3_DIR))(text, add_special_tokens=True)["input_ids"]
    lora = {"name": "sql", "path": "/adapters/sql", "int_id": 7}
    digests = BlockHasher("sha256_cbor", 4, "0", "0.33.0").hash_blocks(ids, lora=lora)
    assert digests and all(d.hex() in proc.stdout for d in digests)


def test_operator_mode_explains_a_bad_request() -> None:
    proc = kvrouter_hash(["--token-ids", "1,2,x"])
    assert proc.returncode == 2
    assert "--token-ids must be comma-separated integers" in proc.stderr
    proc = kvrouter_hash(["--token-ids", "1,2", "--vllm-version", "0.28.0"])
    assert proc.returncode == 2
    assert "PYTHONHASHSEED=0" in proc.stderr
