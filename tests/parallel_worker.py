"""One rank of the tensor-parallel CPU test (``tests/test_parallel.py`` starts two of these).

Run as ``python tests/parallel_worker.py OUT_DIR`` with torchrun's variables ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``FLASHSPEC_TEST_INIT`` (a ``file://`` rendezvous, so no
port can be taken by someone else). Each rank shards the tiny targets, decodes, and writes
what it got to ``OUT_DIR/rank{RANK}.json``; the test compares the ranks with each other and
with single-process decoding. The models and cases are defined here and imported by the test,
so both sides build the same weights.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import HIDDEN, INIT, INTERMEDIATE, LAYERS, noisy_copy, tiny_model  # noqa: E402

NEW_TOKENS = 16
GAMMA = 3
PROMPTS = [[11], [5, 9, 17], [3, 8, 3, 8, 3, 8, 3], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41]]
ARCHS = ("llama", "qwen2", "qwen3-tied")  # GQA; q/k/v biases; q/k norms + tied head + odd vocab
DRAFTERS = ("none", "model", "ngram")
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)


def target(arch: str) -> transformers.PreTrainedModel:
    """The tiny target of case ``arch`` (deterministic)."""
    if arch != "qwen3-tied":
        return tiny_model(arch, seed=len(arch), vocab_size=128)
    # Qwen3 normalises q and k per head; its head is tied to the embedding; a vocabulary of 127
    # does not split evenly over 2 ranks (the last slice is padded).
    config = transformers.Qwen3Config(
        vocab_size=127, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        initializer_range=INIT, use_sliding_window=False, sliding_window=None, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def drafter(arch: str, kind: str, model: transformers.PreTrainedModel) -> Any:
    """The drafter list of a case (``model`` is the whole target, before any sharding)."""
    if kind == "model":
        return [noisy_copy(model, 0.05, seed=100 + len(arch))]
    return [] if kind == "none" else ["ngram"]


def main(out_dir: Path) -> None:
    from flashspec import SpeculativeEngine
    from flashspec.models.parallel import check_shardable, init_tensor_parallel, load_tensor_parallel, shard_model

    torch.set_num_threads(1)
    tp = init_tensor_parallel(backend="gloo", init_method=os.environ["FLASHSPEC_TEST_INIT"])
    result: dict[str, Any] = {"rank": tp.rank, "world_size": tp.world_size}
    for arch in ARCHS:
        whole = target(arch)
        drafters = {kind: drafter(arch, kind, whole) for kind in DRAFTERS}
        model = shard_model(whole)
        case: dict[str, Any] = {}
        for kind in DRAFTERS:
            engine = SpeculativeEngine(model, drafters[kind], device="cpu", selector="fixed")
            out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, num_draft_tokens=GAMMA, eos_token_id=[])
            case[f"greedy/{kind}"] = out.sequences
            lm = engine._target_lm
            case["heads"] = [lm.num_heads, lm.num_kv_heads, list(lm.keys[0].shape)]
        engine = SpeculativeEngine(model, drafters["model"], device="cpu", selector="fixed")  # seeded samples compared: fixed arms
        kwargs = dict(max_new_tokens=NEW_TOKENS, num_draft_tokens=GAMMA, eos_token_id=[], **SAMPLING)
        case["sampled/seed"] = engine.generate(PROMPTS, seed=7, **kwargs).sequences
        case["sampled/no-seed"] = engine.generate(PROMPTS, **kwargs).sequences  # rank 0's seed
        # A learning selector with throughput rewards: every rank must pick the same arms.
        engine = SpeculativeEngine(model, drafters["model"] + ["ngram"], gammas=[1, 3], selector="ucb1", device="cpu")
        out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], **SAMPLING)
        case["ucb1/sequences"] = out.sequences
        case["ucb1/arms"] = {label: s.steps for label, s in out.stats.per_arm.items()}
        # The sharded model also runs through transformers' own generate.
        ids = torch.tensor([PROMPTS[2]])
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        case["hf_generate"] = hf[0, ids.shape[1]:].tolist()
        result[arch] = case
    # A checkpoint loaded straight into shards (transformers saves from rank 0 only).
    folder = out_dir / "checkpoint"
    if tp.rank == 0:
        target("llama").save_pretrained(folder)
    torch.distributed.barrier()
    engine = SpeculativeEngine(load_tensor_parallel(str(folder), device="cpu"), [], device="cpu")
    result["loaded"] = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[]).sequences
    # A model whose 1 key/value head cannot be split over 2 ranks.
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1)
    try:
        shard_model(transformers.LlamaForCausalLM(config))
        result["indivisible"] = None
    except ValueError as error:
        result["indivisible"] = str(error)
    check_shardable(config, 1)  # one process always divides
    (out_dir / f"rank{tp.rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
