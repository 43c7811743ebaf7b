"""Writes a tiny LoRA adapter with random weights for the model make_model.py writes.

Usage: make_lora.py MODEL_DIR OUT_DIR. A PEFT adapter directory (adapter_config.json and
adapter_model.safetensors) of rank 8 on q_proj and v_proj, which vLLM loads with --enable-lora
--max-lora-rank 8 (at start with --lora-modules NAME=OUT_DIR, or at run time through
/v1/load_lora_adapter with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). Needs numpy and safetensors.
"""
import json
import pathlib
import sys

import numpy as np
from safetensors.numpy import save_file

model, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
config = json.loads((model / "config.json").read_text())
hidden, layers = config["hidden_size"], config["num_hidden_layers"]
q_out = config["num_attention_heads"] * config["head_dim"]
v_out = config["num_key_value_heads"] * config["head_dim"]
rank = 8
(out / "adapter_config.json").write_text(json.dumps({
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model),
    "r": rank, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
    "target_modules": ["q_proj", "v_proj"], "modules_to_save": None,
}, indent=1))

rng = np.random.default_rng(1)
tensors = {}
for i in range(layers):
    p = f"base_model.model.model.layers.{i}.self_attn."
    for proj, rows in (("q_proj", q_out), ("v_proj", v_out)):
        tensors[p + proj + ".lora_A.weight"] = (rng.standard_normal((rank, hidden)) * 0.02).astype(np.float32)
        tensors[p + proj + ".lora_B.weight"] = (rng.standard_normal((rows, rank)) * 0.02).astype(np.float32)
save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
print(f"LoRA of rank {rank} -> {out}")
