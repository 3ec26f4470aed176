"""``flashspec bench training``: the table and plot come from the checkpoints' own records."""

import json

import pytest
import torch
from tiny_models import tiny_model

from flashspec.bench.training import bench_training, read_record
from flashspec.cli import main
from flashspec.drafters.checkpoint import save_drafter
from flashspec.training.train import TrainOptions, train_head


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    model = tiny_model("llama", seed=3)
    chunks = torch.randint(0, model.config.vocab_size, (24, 16), generator=torch.Generator().manual_seed(0))
    root = tmp_path_factory.mktemp("ckpt")
    options = TrainOptions(steps=4, batch=4, seq_len=16, estimate_every=2, width=16, heads=2)
    head, log = train_head("feature", model, chunks[:16], options, estimate=chunks[16:], progress=False)
    save_drafter(head, model, root / "general", log)
    options = TrainOptions(layers=1, shared_layers=1, steps=3, batch=4, seq_len=16)
    head, log = train_head("shallow", model, chunks[:16], options, progress=False)
    save_drafter(head, model, root / "shallow", log)
    return root


def test_the_table_reads_each_record(checkpoints, tmp_path):
    general = json.loads((checkpoints / "general" / "drafter.json").read_text())
    assert general["bytes"] == (checkpoints / "general" / "drafter.safetensors").stat().st_size
    copy = tmp_path / "renamed.json"
    copy.write_text(json.dumps(general))
    table = bench_training([str(checkpoints / "general"), str(checkpoints / "shallow"), str(copy)], tmp_path / "out")
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| general", "| shallow", "| renamed"]
    alphas = "/".join(f"{a:.3f}" for a in general["training"]["estimates"][-1]["alpha"])
    assert f"| 4 | {4 * 4 * 16:,} |" in rows[0] and alphas in rows[0] and "MLP 16, 2 heads" in rows[0]
    assert f"{general['bytes'] / 1e6:.1f} MB" in rows[0] and f"{general['bytes'] / 1e6:.1f} MB" in rows[2]
    assert "target's first 1 +" in rows[1] and "| 3 |" in rows[1] and "| — |" in rows[1]  # no estimate, no GPU
    assert (tmp_path / "out" / "training.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "out" / "training.json").read_text())) == 3


def test_the_command_prints_it_and_refuses_what_is_not_a_record(checkpoints, tmp_path, capsys):
    main(["bench", "training", str(checkpoints / "general")])
    assert "| general | feature |" in capsys.readouterr().out
    (tmp_path / "other.json").write_text('{"kind": "feature"}')
    for bad, message in [(tmp_path / "missing", "neither"), (tmp_path / "other.json", "no training record")]:
        with pytest.raises(ValueError, match=message):
            read_record(bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_record(tmp_path / "broken.json")
