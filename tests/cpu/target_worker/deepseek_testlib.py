"""Tiny random DeepSeek-V3 checkpoints built with transformers' own DeepseekV3ForCausalLM.

Shared by the target-runner tests, their TP rank processes and the MTP drafting tests
(import as `deepseek_testlib`; tests elsewhere put this folder on sys.path). The config exercises every switch
the runner reads: q_lora_rank, first_k_dense_replace = 1 (a dense layer, then MoE), grouped
routing (n_group 4, topk_group 2), a shared expert, norm_topk_prob, routed_scaling_factor,
and YaRN with mscale != mscale_all_dim so both the rope table scale and the softmax mscale
matter, with a short original context so the ramp is active.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG = dict(
    vocab_size=97,  # odd: uneven vocab-parallel shards
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
)


def hf_config(**overrides):
    import transformers

    return transformers.DeepseekV3Config(**{**CONFIG, **overrides})


def random_mtp_tensors(cfg, seed: int = 1) -> dict[str, torch.Tensor]:
    """`model.layers.{L}.*` MTP weights: enorm, hnorm, eh_proj, a full (MoE) block, shared head,
    embed_tokens, as the published checkpoint names them; random like the rest."""
    import transformers

    torch.manual_seed(seed)
    layer = cfg.num_hidden_layers
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(cfg, layer)
    h, v = cfg.hidden_size, cfg.vocab_size
    tensors = {}
    for name, t in block_state_dict(block, cfg).items():
        tensors[name] = t
    tensors.update(
        {
            "enorm.weight": torch.empty(h),
            "hnorm.weight": torch.empty(h),
            "eh_proj.weight": torch.empty(h, 2 * h),
            "shared_head.norm.weight": torch.empty(h),
            "shared_head.head.weight": torch.empty(v, h),
            "embed_tokens.weight": torch.empty(v, h),
        }
    )
    for name, t in tensors.items():
        with torch.no_grad():
            if "norm" in name:
                t.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                t.uniform_(-0.1, 0.1)
            else:
                t.normal_(0.0, 0.15)
    return {f"model.layers.{layer}.{k}": t.contiguous() for k, t in tensors.items()}


def block_state_dict(block, cfg) -> dict[str, torch.Tensor]:
    """A transformers decoder layer's tensors under the published per-expert key names."""
    out = {}
    for name, t in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # [E, 2 I, H], gate rows then up rows
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                out[f"mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif name == "mlp.experts.down_proj":  # [E, H, I]
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.detach().clone()
    return out


def save_random_deepseek(path: Path, seed: int = 0, with_mtp: bool = False, **overrides):
    """Saves a random-weight DeepseekV3ForCausalLM as safetensors; returns the fp32 model.

    With `with_mtp`, the MTP layer's tensors are appended under model.layers.{L}.* (transformers
    does not model it, and ignores those keys at load).
    """
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(**overrides)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        # The default init (std 0.02) gives near-uniform logits that hide mistakes.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(-0.1, 0.1)  # the bias must change which experts are chosen
    model.save_pretrained(path, safe_serialization=True)
    if with_mtp:
        tensors = load_file(Path(path) / "model.safetensors")
        tensors.update(random_mtp_tensors(cfg, seed + 1))
        save_file(tensors, Path(path) / "model.safetensors", metadata={"format": "pt"})
    return model


def quantize_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> None:
    """Rewrites a checkpoint in the published FP8 layout: every 2-D projection weight of the
    decoder layers becomes float8_e4m3fn + a float32 `weight_scale_inv` per block, as in
    DeepSeek-V3's release (norms, router gate, embeddings and the head stay unquantised)."""
    from outrider.target_worker.layers.fp8 import quantize_blocks

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(Path(src) / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        quantised = (
            name.startswith("model.layers.")
            and name.endswith(".weight")
            and t.dim() == 2
            and not module.endswith(("norm", "mlp.gate", "embed_tokens", "shared_head.head"))
        )
        if quantised:
            out[name], out[name + "_scale_inv"] = quantize_blocks(t, block)
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((Path(src) / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def dequantized_reference(src: Path, quantized: Path, dst: Path) -> None:
    """The fp32 checkpoint the FP8 one stands for (weights = fp8 x scale, written out plainly)."""
    from outrider.target_worker.layers.fp8 import SCALE_SUFFIX, dequantize_blocks

    config = json.loads((quantized / "config.json").read_text())
    block = tuple(config["quantization_config"]["weight_block_size"])
    tensors = load_file(quantized / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        out[name] = t if scale is None else dequantize_blocks(t, scale, block)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((Path(src) / "config.json").read_text())


def tp_rank_check(tp, checkpoint_paths: list[str], atol: float) -> None:
    """Runs in each TP rank: the sharded runner's scenario equals an unsharded runner's."""
    from target_runner_testlib import run_scenario

    from outrider.target_worker.batch import HiddenCapture
    from outrider.target_worker.runner import ModelRunner

    for path in checkpoint_paths:
        sharded = ModelRunner.from_pretrained(path, max_model_len=64, tp=tp)
        single = ModelRunner.from_pretrained(path, max_model_len=64)
        # Really sharded: half the heads and half the routed experts of each MoE layer here.
        assert sharded.model.blocks[0].num_heads * 2 == single.model.blocks[0].num_heads
        assert len(sharded.model.blocks[-1].mlp.experts) * 2 == len(single.model.blocks[-1].mlp.experts)
        capture = HiddenCapture(layer_inputs=(1,), final=True)
        ours = run_scenario(sharded, single.model.vocab_size, capture=capture)
        reference = run_scenario(single, single.model.vocab_size, capture=capture)
        for step, (a, b) in enumerate(zip(ours.outputs, reference.outputs, strict=True)):
            where = f"rank {tp.rank}, {path}, step {step}"
            assert a.logits.shape == b.logits.shape, where
            assert (a.logits - b.logits).abs().max() <= atol, where
            assert (a.final_hidden - b.final_hidden).abs().max() <= atol, where
            assert (a.layer_inputs[1] - b.layer_inputs[1]).abs().max() <= atol, where
