"""The full K2.5 vision-language model against transformers' ``Kimi_K25ForConditionalGeneration``.

Random tiny fp32 configs, both directions through checkpoint directories: ours -> ``to_hf`` (Moonshot's
original names, fused rope-interleaved ``wqkv``) -> transformers ``from_pretrained``, and transformers
``save_pretrained`` / in-memory names -> our ``from_hf``. Inputs mix images of different sizes and video
volumes in a left-padded batch, as transformers' processor lays them out.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from k2lab import load_preset
from k2lab.hf import from_hf, to_hf
from k2lab.hf.kimi_k25 import config_to_hf, rope_row_order
from k2lab.vision import VisionConfig
from k2lab.vision.vlm import VisionLanguageModel, VLMConfig, build_vlm
from tests.conftest import randomize

pytest.importorskip("transformers")
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: E402

TOL = 1e-4
VOCAB = 300
IMAGE, VIDEO, START, END = 290, 291, 292, 293
VISION = {
    "k2x2": dict(
        patch_size=4, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2, num_hidden_layers=2,
        hidden_size=32, intermediate_size=64,
    ),
    "k2x1-theta100": dict(
        patch_size=2, pos_emb_height=6, pos_emb_width=6, num_attention_heads=4, num_hidden_layers=1,
        hidden_size=48, intermediate_size=40, merge_kernel_size=(2, 1), hidden_act="gelu", rope_theta=100.0,
    ),
}  # fmt: skip
TEXT = {
    "k2-nano": dict(tie_word_embeddings=False),
    "k2-nano-tied": dict(tie_word_embeddings=True),
}
IMAGES = [[1, 4, 6], [1, 6, 4]]
VIDEOS = [[4, 4, 4], [2, 4, 4]]


def vlm_config(vision: str, text: str) -> VLMConfig:
    text_config = load_preset("k2-nano", vocab_size=VOCAB, **TEXT[text])
    vision_config = VisionConfig(**VISION[vision], text_hidden_size=text_config.hidden_size)
    return VLMConfig(
        text=text_config,
        vision=vision_config,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


@pytest.fixture(params=[("k2x2", "k2-nano"), ("k2x1-theta100", "k2-nano-tied")], ids=lambda p: "-".join(p))
def config(request) -> VLMConfig:
    return vlm_config(*request.param)


def multimodal_inputs(config: VLMConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two left-padded sequences: row 0 holds both images, row 1 both video volumes; text around them."""
    g = torch.Generator().manual_seed(seed)
    kh, kw = config.vision.merge_kernel_size
    p = config.vision.patch_size

    def tokens(grid: list[list[int]]) -> list[int]:
        return [(h // kh) * (w // kw) for _, h, w in grid]

    def text(n: int) -> list[int]:
        return torch.randint(3, 280, (n,), generator=g).tolist()

    def media(count: int, pad: int) -> list[int]:
        return [START, *[pad] * count, END]

    row0 = text(3) + media(tokens(IMAGES)[0], IMAGE) + text(2) + media(tokens(IMAGES)[1], IMAGE) + text(4)
    row1 = text(2) + media(tokens(VIDEOS)[0], VIDEO) + media(tokens(VIDEOS)[1], VIDEO) + text(1)
    width = max(len(row0), len(row1))
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate((row0, row1)):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1

    def pixels(grid: list[list[int]]) -> torch.Tensor:
        n = sum(t * h * w for t, h, w in grid)
        return torch.randn(n, 3, p, p, generator=g)

    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": pixels(IMAGES),
        "image_grid_thw": torch.tensor(IMAGES),
        "pixel_values_videos": pixels(VIDEOS),
        "video_grid_thw": torch.tensor(VIDEOS),
    }


def our_logits(model: VisionLanguageModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def hf_logits(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> float:
    valid = mask.bool()
    delta = (ours[valid] - theirs[valid]).abs().max().item()
    print(f"max |Δlogit| = {delta:.2e}")
    assert delta <= TOL, delta
    return delta


def random_vlm(config: VLMConfig, seed: int) -> VisionLanguageModel:
    model = build_vlm(config)
    randomize(model, seed=seed)
    return model.eval()


def test_ours_to_transformers(config: VLMConfig, tmp_path) -> None:
    model = random_vlm(config, seed=0)
    to_hf(model, tmp_path / "ckpt")
    keys = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert keys["model_type"] == "kimi_k25"
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager"
    ).eval()
    inputs = multimodal_inputs(config)
    assert_close(our_logits(model, inputs), hf_logits(reference, inputs), inputs["attention_mask"])
    # the pixels matter: other images and videos change the text logits after them, in both models
    other = {
        **inputs,
        "pixel_values": -inputs["pixel_values"],
        "pixel_values_videos": -inputs["pixel_values_videos"],
    }
    for run in (lambda x: our_logits(model, x), lambda x: hf_logits(reference, x)):
        assert (run(other)[:, -1] - run(inputs)[:, -1]).abs().max() > 1e-3


def hf_reference(config: VLMConfig, seed: int):
    hf_config = Kimi_K25Config(**{k: v for k, v in config_to_hf(config).items() if k != "architectures"})
    reference = Kimi_K25ForConditionalGeneration(hf_config)
    randomize(reference, seed=seed)
    return reference.eval()


def test_transformers_to_ours(config: VLMConfig, tmp_path) -> None:
    reference = hf_reference(config, seed=1)
    reference.save_pretrained(tmp_path / "saved")
    model = from_hf(tmp_path / "saved")
    assert isinstance(model, VisionLanguageModel)
    inputs = multimodal_inputs(config, seed=1)
    assert_close(our_logits(model, inputs), hf_logits(reference, inputs), inputs["attention_mask"])


def test_transformers_in_memory_names(config: VLMConfig, tmp_path) -> None:
    """A checkpoint holding transformers' in-memory names (unfused q/k/v, ``model.language_model.*``)."""
    reference = hf_reference(config, seed=2)
    folder = tmp_path / "memory"
    folder.mkdir()
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    if config.text.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config_to_hf(config)))
    model = from_hf(folder)
    inputs = multimodal_inputs(config, seed=2)
    assert_close(our_logits(model, inputs), hf_logits(reference, inputs), inputs["attention_mask"])


def test_round_trip_is_exact(config: VLMConfig, tmp_path) -> None:
    model = random_vlm(config, seed=3)
    to_hf(model, tmp_path / "a")
    again = from_hf(tmp_path / "a")
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key


def test_rope_row_order_interleaves_halves() -> None:
    # one head of 4 rows: disk rows (0, 1, 2, 3) hold our rows (0, 2, 1, 3); two heads shift by 4
    assert rope_row_order(1, 4) == (0, 2, 1, 3)
    assert rope_row_order(2, 4) == (0, 2, 1, 3, 4, 6, 5, 7)


def test_placeholder_mismatch_is_a_clear_error(config: VLMConfig) -> None:
    model = random_vlm(config, seed=4)
    inputs = multimodal_inputs(config)
    inputs["image_grid_thw"] = torch.tensor([IMAGES[0]])
    inputs["pixel_values"] = inputs["pixel_values"][: IMAGES[0][1] * IMAGES[0][2]]
    with pytest.raises(ValueError, match="image placeholders"):
        model(**inputs)
    text_only = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with pytest.raises(ValueError, match="no image pixels"):
        model(**text_only)
