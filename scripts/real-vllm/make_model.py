"""Writes a tiny Llama model directory with random weights around the BOS test tokenizer.

Usage: make_model.py TOKENIZER_DIR OUT_DIR. Needs numpy and safetensors (no torch, no model hub).
The shape is small enough for a 2-core CPU: hidden 256, 2 layers, 4 heads of 64, 2 KV heads.
"""
import json
import pathlib
import shutil
import sys

import numpy as np
from safetensors.numpy import save_file

src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(src / name, out / name)

tokenizer = json.loads((src / "tokenizer.json").read_text())
vocab = dict(tokenizer["model"]["vocab"])
for added in tokenizer.get("added_tokens", []):
    vocab[added["content"]] = added["id"]
special = json.loads((src / "tokenizer_config.json").read_text())
vocab_size = max(vocab.values()) + 1
hidden, inter, layers, heads, kv_heads, head_dim = 256, 512, 2, 4, 2, 64
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
    "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
    "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": vocab[special["bos_token"]], "eos_token_id": vocab[special["eos_token"]],
}
(out / "config.json").write_text(json.dumps(config, indent=1))
(out / "generation_config.json").write_text(
    json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))

rng = np.random.default_rng(0)


def weight(*shape):
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


tensors = {
    "model.embed_tokens.weight": weight(vocab_size, hidden),
    "model.norm.weight": np.ones(hidden, np.float32),
    "lm_head.weight": weight(vocab_size, hidden),
}
for i in range(layers):
    p = f"model.layers.{i}."
    tensors.update({
        p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": weight(inter, hidden),
        p + "mlp.up_proj.weight": weight(inter, hidden),
        p + "mlp.down_proj.weight": weight(hidden, inter),
        p + "input_layernorm.weight": np.ones(hidden, np.float32),
        p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
    })
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
print(f"{sum(t.size for t in tensors.values())} parameters -> {out}")
