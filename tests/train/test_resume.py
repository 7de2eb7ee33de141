"""Which settings a resumed run may change (``k2lab.train.resume``)."""

import pytest

from k2lab.errors import CheckpointError
from k2lab.train.config import TrainConfig
from k2lab.train.resume import check_resumed_data, check_resumed_settings, flat_settings


def test_nested_settings_flatten_to_dotted_keys():
    assert flat_settings({"a": 1, "optimizer": {"lr": 2, "x": {"y": 3}}, "empty": {}}) == {
        "a": 1,
        "optimizer.lr": 2,
        "optimizer.x.y": 3,
        "empty": {},
    }


def test_the_runs_length_cadence_and_hardware_choices_may_change_nothing_else(tmp_path):
    saved = TrainConfig().model_dump(mode="json")
    allowed = {"steps": 900, "save_every": 7, "precision": "fp32", "compile": "off", "out": "elsewhere"}
    changed = TrainConfig(**allowed, optimizer={"ns_precision": "fp32"}).model_dump(mode="json")
    check_resumed_settings(saved, changed, tmp_path)
    check_resumed_settings(None, changed, tmp_path)  # a checkpoint from before configs were saved
    for other in ({"optimizer": {"lr": 0.05}}, {"batch_size": 4}, {"seed": 7}, {"preset": "k3-mini"}):
        key = next(iter(flat_settings(other)))
        with pytest.raises(CheckpointError, match=f"{key}: .* then, .* now"):
            check_resumed_settings(saved, TrainConfig(**other).model_dump(mode="json"), tmp_path)


def test_a_resume_on_another_corpus_or_tokenizer_names_which(tmp_path):
    saved = {"corpus": "a" * 64, "tokenizer": "b" * 64}
    check_resumed_data(saved, dict(saved), tmp_path)
    check_resumed_data(None, saved, tmp_path)  # a checkpoint from before fingerprints were recorded
    check_resumed_data({"tokenizer": "b" * 64}, saved, tmp_path)  # an SFT run without PTX records no corpus
    with pytest.raises(CheckpointError, match="another corpus .*aaaaaaaaaaaa then, cccccccccccc now"):
        check_resumed_data(saved, {"corpus": "c" * 64, "tokenizer": "d" * 64}, tmp_path)
    with pytest.raises(CheckpointError, match="another tokenizer .* or choose a new output directory"):
        check_resumed_data(saved, {**saved, "tokenizer": "d" * 64}, tmp_path)
