"""metrics.jsonl + TensorBoard logging, resume truncation, and the PNG dashboard."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from k2lab.errors import K2LabError
from k2lab.train.dashboard import plot_dashboard
from k2lab.train.metrics import MetricsLogger, read_metrics, scan_metrics, truncate_metrics


def values_at(step: int) -> dict:
    return {"loss": 5.0 / step, "lr": 1e-3, "expert_load/layer1": [float(step), 2.0, 3.0]}


def test_lines_are_flushed_json_objects(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss": 2.5, "tokens": 4096, "grad_norm": torch.tensor(0.5), "np": np.float32(0.25)})
    logger.log(
        2, {"expert_load/layer3": torch.tensor([1.0, 2.0]), "ratio": np.array([0.5, 1.5]), "nan": math.nan}
    )
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # readable before close: flushed
    assert json.loads(lines[0]) == {"step": 1, "loss": 2.5, "tokens": 4096, "grad_norm": 0.5, "np": 0.25}
    records = read_metrics(tmp_path)
    assert records[1]["expert_load/layer3"] == [1.0, 2.0] and records[1]["ratio"] == [0.5, 1.5]
    assert math.isnan(records[1]["nan"])
    with pytest.raises(TypeError, match="'name'"):
        logger.log(3, {"name": "abc"})
    with pytest.raises(ValueError):
        logger.log(3, {"step": 1.0})
    logger.close()
    logger.close()
    assert len(read_metrics(tmp_path)) == 2
    assert read_metrics(tmp_path / "nowhere") == []


def test_resume_truncates_to_match_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    with MetricsLogger(straight, tensorboard=False) as logger:
        for step in range(1, 11):
            logger.log(step, values_at(step))

    with MetricsLogger(killed, tensorboard=False) as logger:
        for step in range(1, 8):
            logger.log(step, values_at(step))
    with open(killed / "metrics.jsonl", "a") as handle:  # the kill cut a line in half
        handle.write('{"step": 8, "loss": 0.6')
    assert [r["step"] for r in read_metrics(killed)] == list(range(1, 8))

    with MetricsLogger(killed, tensorboard=False, resume_step=5) as logger:  # last checkpoint: step 5
        assert [r["step"] for r in read_metrics(killed)] == [1, 2, 3, 4, 5]
        for step in range(6, 11):
            logger.log(step, values_at(step))
    assert (killed / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
    assert not [p for p in killed.iterdir() if p.name.startswith(".")]


def test_append_after_partial_line_starts_a_new_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(3, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3]


def test_tensorboard_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 4):
            logger.log(step, values_at(step))
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    accumulator.Reload()
    assert [e.value for e in accumulator.Scalars("loss")] == pytest.approx([5.0, 2.5, 5.0 / 3])
    assert [h.step for h in accumulator.Histograms("expert_load/layer1")] == [1, 2, 3]

    with MetricsLogger(tmp_path, resume_step=1) as logger:  # resumed: TensorBoard hides steps 2, 3 of before
        logger.log(2, {"loss": 7.0})
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [(1, 5.0), (2, 7.0)]


def synthetic_metrics(run_dir: Path, steps: int = 120, layers: int = 4, experts: int = 8) -> None:
    rng = random.Random(0)
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        for step in range(1, steps + 1):
            values: dict = {
                "loss": 6 * math.exp(-step / 40) + 2 + 0.05 * rng.random(),
                "lr": 2e-3 * min(1.0, step / 10),
                "qk_clipped_heads": float(rng.random() < 0.2) * rng.randint(1, 4),
                "qk_clip_ever_frac": min(0.125, step / 800),
            }
            for layer in range(layers):
                values[f"max_logit/layer{layer}"] = min(100.0, 30 + 10 * layer + step)
            for layer in range(1, layers):
                values[f"expert_load/layer{layer}"] = [
                    rng.random() + (e == 0) * 3 * math.exp(-step / 30) for e in range(experts)
                ]
            if step % 20 == 0:
                values["val_loss"] = values["loss"] + 0.1
            logger.log(step, values)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_dashboard_png(tmp_path: Path) -> None:
    synthetic_metrics(tmp_path)
    path = plot_dashboard(tmp_path, tau=100.0)
    assert path == tmp_path / "dashboard.png"
    assert png_size(path) == (1400, 900)
    assert path.stat().st_size > 50_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_dashboard_missing_keys_say_no_data(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    assert png_size(plot_dashboard(tmp_path)) == (1400, 900)
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"loss": 3.0})
        logger.log(2, {"loss": 2.0, "expert_imbalance/layer1": 1.5})
    out = plot_dashboard(tmp_path, output=tmp_path / "plots" / "d.png")
    assert png_size(out) == (1400, 900)
    with pytest.raises(K2LabError, match="metrics.jsonl"):
        plot_dashboard(tmp_path / "missing")


def test_loss_panel_draws_the_mtp_loss_when_logged() -> None:
    from matplotlib.figure import Figure

    from k2lab.train.dashboard import _plot_loss

    def labels(records: list[dict]) -> list[str]:
        ax = Figure().subplots()
        _plot_loss(ax, records)
        return [line.get_label() for line in ax.get_lines()]

    plain = [{"step": s, "loss": 3.0 - s / 10} for s in range(1, 4)]
    assert labels(plain) == ["train loss"]
    with_mtp = [dict(r, mtp_loss=r["loss"] + 0.2) for r in plain]
    assert labels(with_mtp) == ["train loss", "MTP loss (mean over depths)"]


GOOD_AND_BAD = b'{"step": 1, "loss": 2.0}\ngarbage\n\xff\xfe\x00\n\n{"step": 2, "loss": 1.0}\n{"step": 3'


def test_undecodable_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 raised UnicodeDecodeError from every reader; they are unreadable lines now,
    counted (blank lines are not), and a resume truncation keeps the good lines byte for byte."""
    (tmp_path / "metrics.jsonl").write_bytes(GOOD_AND_BAD)
    records, skipped = scan_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and skipped == 3
    assert read_metrics(tmp_path) == records and scan_metrics(tmp_path / "missing") == ([], 0)
    assert truncate_metrics(tmp_path, 1) == 1
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1, "loss": 2.0}\n'


@pytest.mark.parametrize(
    "content", [b"", b"\n\n", bytes(random.Random(0).randrange(256) for _ in range(3000))]
)
def test_plot_refuses_metrics_without_a_readable_record_and_keeps_the_dashboard(tmp_path, capsys, content):
    """An empty, blank or random-bytes metrics.jsonl drew a blank dashboard over a good one (exit code 0) or
    ended in a UnicodeDecodeError traceback."""
    from k2lab.cli import main

    (tmp_path / "metrics.jsonl").write_bytes(content)
    (tmp_path / "dashboard.png").write_bytes(b"good dashboard")
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path)])
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'metrics.jsonl'} holds no readable records" in err and "Traceback" not in err
    assert (tmp_path / "dashboard.png").read_bytes() == b"good dashboard"


def test_plot_draws_the_readable_lines_and_says_how_many_were_skipped(tmp_path, capsys) -> None:
    from k2lab.cli import main

    (tmp_path / "metrics.jsonl").write_bytes(GOOD_AND_BAD)
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path)])
    assert exit_info.value.code in (0, None)
    assert "skipped 3 unreadable line(s)" in " ".join(capsys.readouterr().out.split())
    assert png_size(tmp_path / "dashboard.png") == (1400, 900)


def test_plot_takes_tau_from_a_finished_runs_summary(tmp_path, monkeypatch) -> None:
    """`k2lab plot RUN` on a training run redrew the dashboard without the τ line the trainer drew: only an
    ablation marker was read. A finished run's summary.json records it now."""
    from k2lab.cli import main

    drawn = []
    monkeypatch.setattr("k2lab.train.dashboard.plot_dashboard", lambda run, tau: drawn.append(tau) or run)
    (tmp_path / "metrics.jsonl").write_bytes(GOOD_AND_BAD)
    for summary, expected in (None, None), ({"val_loss": 1.0}, None), ({"qk_clip_tau": 30.0}, 30.0):
        if summary is not None:
            (tmp_path / "summary.json").write_text(json.dumps(summary))
        with pytest.raises(SystemExit):
            main(["plot", str(tmp_path)])
        assert drawn[-1] == expected
