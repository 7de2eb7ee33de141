import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.errors import K2LabError
from k2lab.train.config import load_train_config
from k2lab.train.curriculum import CurriculumStage, rope_scaling_for, stage_index

STAGES = [
    CurriculumStage(start_step=0, seq_len=64),
    CurriculumStage(start_step=10, seq_len=128, yarn_factor=2.0),
    CurriculumStage(start_step=20, seq_len=256, yarn_factor=4.0),
]


def test_stage_lookup():
    assert [stage_index(STAGES, s) for s in (0, 9, 10, 19, 20, 99)] == [0, 0, 1, 1, 2, 2]


def test_yarn_switch_equals_a_model_built_with_that_scaling():
    model = build_model(load_preset("k2-nano", rope_scaling=None))
    scaling = rope_scaling_for(STAGES, 2)
    assert scaling.factor == 4 and scaling.original_max_position_embeddings == 64
    model.set_rope_scaling(scaling)
    reference = build_model(load_preset("k2-nano", rope_scaling=scaling.model_dump()))
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (1, 200))
    assert torch.equal(model(ids).logits, reference(ids).logits)
    assert rope_scaling_for(STAGES, 0) is None


def test_recipe_validation(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[[curriculum]]\nstart_step = 5\nseq_len = 64\n")
    with pytest.raises(K2LabError, match="first stage must start at step 0"):
        load_train_config(recipe)
    recipe.write_text(
        "[[curriculum]]\nstart_step = 0\nseq_len = 64\n[[curriculum]]\nstart_step = 0\nseq_len = 128\n"
    )
    with pytest.raises(K2LabError, match="must increase"):
        load_train_config(recipe)
    assert load_train_config(seq_len=99).stages()[0].seq_len == 99


def test_curriculum_run_switches_stages_and_resumes_across_the_boundary(tmp_path, tiny_corpus):
    import json
    import shutil

    from k2lab.train.metrics import read_metrics
    from k2lab.train.trainer import run_training
    from tests.conftest import tiny_recipe

    path = tiny_recipe(tmp_path / "r.toml", tiny_corpus, steps=8, save_every=4, eval_every=4)
    path.write_text(
        path.read_text()
        + "[[curriculum]]\nstart_step = 0\nseq_len = 16\n"
        + "[[curriculum]]\nstart_step = 5\nseq_len = 48\nyarn_factor = 3.0\n"
    )
    full = tmp_path / "full"
    run_training(load_train_config(path, out=str(full)))
    manifest = json.loads((full / "model" / "k2lab.json").read_text())
    scaling = manifest["config"]["rope_scaling"]
    assert scaling["factor"] == 3.0 and scaling["original_max_position_embeddings"] == 16
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[5]["tokens_per_s"] > 0

    # resume from the stage-0 checkpoint at step 4: steps 5-8 (stage 1, YaRN on) must repeat exactly
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_00000008")
    run_training(load_train_config(path, out=str(part)), resume=True)
    assert [(r["step"], r["loss"]) for r in read_metrics(part)] == [(r["step"], r["loss"]) for r in rows]


def test_sequences_longer_than_the_models_context_are_refused():
    """seq_len past max_position_embeddings trained positions the saved model then refuses (an SFT at 1,024
    tokens on a 256-token model left every RL rollout failing as "context overflow")."""
    assert load_train_config(preset="k2-nano", seq_len=256).seq_len == 256
    with pytest.raises(K2LabError, match=r"seq_len 257 exceeds the context of preset 'k2-nano' \(max_posit"):
        load_train_config(preset="k2-nano", seq_len=257)
    stages = [{"start_step": 0, "seq_len": 128}, {"start_step": 5, "seq_len": 512, "yarn_factor": 4.0}]
    with pytest.raises(K2LabError, match="seq_len 512 exceeds"):
        load_train_config(preset="k2-nano", curriculum=stages)
    longer = load_train_config(
        preset="k2-nano", curriculum=stages, model_overrides={"max_position_embeddings": 512}
    )
    assert longer.stages()[-1].seq_len == 512
    with pytest.raises(K2LabError, match="exceeds the context of preset 'k25-nano'"):  # its language model's
        load_train_config(preset="k25-nano", seq_len=4096)
