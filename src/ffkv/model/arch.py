"""Where each architecture keeps its FFN, norms and unembedding.

Adding an architecture is one entry in ARCHITECTURES: attribute paths and how the
weights are laid out. Nothing else in ffkv branches on the model type.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    layers: str  # path from the CausalLM to the list of decoder blocks
    final_norm: str  # path from the CausalLM to the final norm
    unembed: str  # fallback path to the output projection; get_output_embeddings() comes first
    # Paths inside one block. For gated FFNs `key` is the gate projection, `up` the up projection.
    key: str
    value: str
    up: str | None = None
    act: str | None = None  # path inside the block to the activation module (None: from config)
    # "linear": weight stored out x in (nn.Linear). "conv1d": in x out (GPT-2's Conv1D).
    layout: str = "linear"
    act_config: str = "hidden_act"  # config attribute naming the activation


ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture(
        "gpt2", layers="transformer.h", final_norm="transformer.ln_f", unembed="lm_head",
        key="mlp.c_fc", value="mlp.c_proj", act="mlp.act", layout="conv1d",
        act_config="activation_function"),
    "gpt_neox": Architecture(
        "gpt_neox", layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
        unembed="lm_head", key="mlp.dense_h_to_4h", value="mlp.dense_4h_to_h", act="mlp.act"),
    "opt": Architecture(
        "opt", layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm",
        unembed="lm_head", key="fc1", value="fc2", act="activation_fn",
        act_config="activation_function"),
    "llama": Architecture(
        "llama", layers="model.layers", final_norm="model.norm", unembed="lm_head",
        key="mlp.gate_proj", up="mlp.up_proj", value="mlp.down_proj", act="mlp.act_fn"),
}
# Llama-shaped gated FFNs under other names share the same layout.
for _alias in ("mistral", "qwen2", "qwen3"):
    ARCHITECTURES[_alias] = Architecture(**{**ARCHITECTURES["llama"].__dict__, "name": _alias})


def get_path(obj, path: str):
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj
