"""The MTP layer against a reference written here from the DeepSeek-V3 / GLM description, and the
loader's strictness (names, shapes, dtypes)."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_hf_model

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.loader import CheckpointError
from engine.load import load_model


def add_mtp_layer(hf, model_dir, seed=7):
    """Append an MTP layer as GLM checkpoints store it: ``model.layers.{N}.*`` with per-expert tensors.
    Returns the transformers decoder block used as its reference plus the extra MTP tensors."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer
    cfg = hf.config
    N, H = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(seed)
    block = GlmMoeDsaDecoderLayer(cfg, N - 1).eval()  # an MoE layer with its own indexer
    with torch.no_grad():
        for _n, p in block.named_parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.uniform_(0.8, 1.2)
        block.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    extra = {"enorm.weight": torch.rand(H) + 0.5, "hnorm.weight": torch.rand(H) + 0.5,
             "eh_proj.weight": torch.randn(H, 2 * H) * 0.08, "shared_head.norm.weight": torch.rand(H) + 0.5,
             "shared_head.head.weight": hf.lm_head.weight.detach().clone(),
             "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone()}
    tensors = {f"model.layers.{N}.{k}": v for k, v in extra.items()}
    I = cfg.moe_intermediate_size
    for n, p in block.state_dict().items():
        if n == "mlp.experts.gate_up_proj":
            for e in range(p.shape[0]):
                tensors[f"model.layers.{N}.mlp.experts.{e}.gate_proj.weight"] = p[e, :I].clone()
                tensors[f"model.layers.{N}.mlp.experts.{e}.up_proj.weight"] = p[e, I:].clone()
        elif n == "mlp.experts.down_proj":
            for e in range(p.shape[0]):
                tensors[f"model.layers.{N}.mlp.experts.{e}.down_proj.weight"] = p[e].clone()
        else:
            tensors[f"model.layers.{N}.{n}"] = p.clone()
    path = os.path.join(model_dir, "model.safetensors")
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    c["num_nextn_predict_layers"] = 1
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(c, f)
    return block, extra


def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_layer_matches_reference(tmp_path):
    hf = make_hf_model("dsa")
    hf.save_pretrained(tmp_path)
    block, extra = add_mtp_layer(hf, str(tmp_path))
    model, cfg = load_model(str(tmp_path), "float32", "cpu")
    assert cfg.num_mtp_layers == 1 and model.has_mtp
    T = 40  # > index_topk: the MTP block's own DSA indexer is exercised
    ids = torch.randint(2, cfg.vocab_size, (T + 1,))
    eps = hf.config.rms_norm_eps
    # Reference (DeepSeek-V3 sec. 2.2): h'_i = M [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))] in GLM's order
    # [enorm(emb); hnorm(h)], then the Transformer block, then the shared head's norm and the LM head.
    with torch.no_grad():
        h = hf.model(ids[None, :T]).last_hidden_state  # final-normed main hidden states h_i
        e = hf.model.embed_tokens(ids[None, 1:T + 1])
        x = torch.cat([rms(e, extra["enorm.weight"], eps), rms(h, extra["hnorm.weight"], eps)], -1)
        x = x @ extra["eh_proj.weight"].T
        pos = torch.arange(T)[None]
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
        x, _ = block(x, attention_mask=mask, position_ids=pos,
                     position_embeddings=hf.model.rotary_emb(x, pos))
        ref = rms(x, extra["shared_head.norm.weight"], eps) @ hf.lm_head.weight.T
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 16)
    assert pool.layout.num_layers == cfg.num_hidden_layers + 1
    pages = pool.allocator.alloc(5, "m")
    main = model(ForwardBatch.build([BatchRequest(pages, 0, ids[:T].tolist())], 8), pool, all_logits=True)
    assert (main.hidden - h[0]).abs().max() < 1e-4
    mtp_batch = ForwardBatch.build([BatchRequest(pages, 0, ids[1:T + 1].tolist())], 8)
    out = model.forward_mtp(mtp_batch, pool, main.hidden, all_logits=True)
    assert (out.logits - ref[0]).abs().max().item() < 1e-4
    # its KV went to the MTP layer's own slot in the pool
    assert pool.buffers[cfg.num_hidden_layers]["latent"][pages[0]].abs().sum() > 0
    # the prefill worker's KV-only MTP pass writes exactly that KV
    full = {n: t.clone() for n, t in pool.buffers[cfg.num_hidden_layers].items()}
    for t in pool.buffers[cfg.num_hidden_layers].values():
        t.zero_()
    model.mtp_kv(mtp_batch, pool, main.hidden)
    assert all(torch.equal(pool.buffers[cfg.num_hidden_layers][n], t) for n, t in full.items())


@pytest.mark.parametrize("kind", ["dsa", "gqa"])
@pytest.mark.parametrize("cached", [0, 12])  # a fresh chunk, and one over a cached prefix
def test_write_kv_writes_what_forward_writes(tiny_dirs, kind, cached):
    """``write_kv`` (KV without attention) leaves every layer's cache bit for bit as ``forward`` does."""
    model, cfg = load_model(tiny_dirs[kind], "float32", "cpu")
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pool = KVPool(KVLayout.for_model(cfg, 8, "float32"), 16)
    batch = ForwardBatch.build([BatchRequest(pool.allocator.alloc(6, "w"), cached, list(range(2, 32)))], 8)
    for layer in model.model.layers:
        with torch.inference_mode():
            layer.self_attn(x, batch, pool, model.rope(), None)
        want = {n: t.clone() for n, t in pool.buffers[layer.layer_idx].items()}
        for t in pool.buffers[layer.layer_idx].values():
            t.zero_()
        with torch.inference_mode():
            layer.self_attn.write_kv(x, batch, pool, model.rope())
        assert all(torch.equal(pool.buffers[layer.layer_idx][n], t) for n, t in want.items()), layer.layer_idx


def _rewrite(model_dir, fn):
    path = os.path.join(model_dir, "model.safetensors")
    t = load_file(path)
    fn(t)
    save_file(t, path, metadata={"format": "pt"})


@pytest.fixture
def ckpt(tiny_dirs, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_dirs["dsa"], d)
    return str(d)


def test_wrong_shape_names_tensor_and_rule(ckpt):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, torch.zeros(5, 7)))
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, "float32", "cpu")
    msg = str(e.value)
    assert name in msg and "(32, 64)" in msg and "(5, 7)" in msg and "expert" in msg and "w13" in msg


def test_unknown_tensor_is_an_error(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.bogus.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="bogus.*does not have"):
        load_model(ckpt, "float32", "cpu")


def test_missing_tensor_is_an_error(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"not \(fully\) loaded.*experts\.w2"):
        load_model(ckpt, "float32", "cpu")


def test_packed_uint8_into_bf16_slot_is_an_error(ckpt):
    """The reference deployment's trap in reverse: 4-bit packed bytes must never load into a float slot."""
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, torch.zeros(32, 64, dtype=torch.uint8)))
    with pytest.raises(CheckpointError, match="dtype mismatch.*uint8"):
        load_model(ckpt, "float32", "cpu")


def test_sharded_checkpoint_loads(ckpt, tmp_path):
    t = load_file(os.path.join(ckpt, "model.safetensors"))
    names = sorted(t)
    os.remove(os.path.join(ckpt, "model.safetensors"))
    half = len(names) // 2
    wm = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: t[n] for n in part}, os.path.join(ckpt, fn), metadata={"format": "pt"})
        wm.update({n: fn for n in part})
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    model, cfg = load_model(ckpt, "float32", "cpu")
    assert torch.equal(model.model.layers[1].mlp.experts.w2[0], t["model.layers.1.mlp.experts.0.down_proj.weight"])
