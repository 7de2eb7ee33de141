"""`k2lab generate --image` and `k2lab serve` on a vision-language checkpoint: bad images, placeholder
tokens without an image, speculative flags and oversized images are one-line errors (exit 2); images reach
the processor unconverted; serve says it serves text only."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from k2lab.cli import main
from k2lab.data.tokenizer import IMAGE_PAD
from k2lab.model_dir import save_model
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision.vlm import build_vlm


@pytest.fixture
def vlm_dir(tmp_path, small_tokenizer):
    """A random k25-nano checkpoint (context 256) with its tokenizer."""
    path = tmp_path / "vl"
    config = load_vlm_preset("k25-nano", small_tokenizer.special_tokens, vocab_size=300)
    save_model(build_vlm(config), path)
    small_tokenizer.save(path / "tokenizer.json")
    return path


def clean_error(capsys, args: list[str]) -> str:
    """Run `k2lab ARGS` in-process; assert exit code 2 and no traceback; the error line, unwrapped."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    return " ".join(err.split())


def test_unreadable_images_are_one_line_errors(vlm_dir, tmp_path, capsys, monkeypatch):
    generate = ["generate", "-c", vlm_dir, "--prompt", "hi", "--max-new-tokens", "2", "--image"]
    bomb = tmp_path / "bomb.png"
    Image.new("L", (40, 40), 90).save(bomb)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 1,600 pixels > 2 × limit: DecompressionBombError
    assert "cannot read image" in clean_error(capsys, [*generate, bomb])
    monkeypatch.undo()
    truncated = tmp_path / "truncated.png"
    Image.effect_noise((300, 300), 60).save(tmp_path / "whole.png")
    truncated.write_bytes((tmp_path / "whole.png").read_bytes()[:2000])  # opens, fails to decode
    assert f"cannot read image {truncated}" in clean_error(capsys, [*generate, truncated])


def test_placeholders_without_an_image_are_refused(vlm_dir, small_tokenizer, capsys):
    pad = small_tokenizer.special_tokens[IMAGE_PAD]
    generate = ["generate", "-c", vlm_dir, "--max-new-tokens", "2"]
    error = clean_error(capsys, [*generate, "--prompt", f"{IMAGE_PAD} hi"])
    assert f"holds 1 image placeholder token(s) (id {pad}) but no --image was given" in error
    error = clean_error(capsys, [*generate, "--token-ids", "--prompt", f"{pad} {pad} 5"])
    assert "holds 2 image placeholder token(s)" in error


def test_speculative_flags_are_refused_with_an_image(vlm_dir, tmp_path, capsys):
    image = tmp_path / "small.png"
    Image.new("RGB", (40, 40)).save(image)
    generate = ["generate", "-c", vlm_dir, "--prompt", "hi", "--image", image]
    for flags in (["--draft", tmp_path / "missing"], ["--speculative"]):
        assert "speculative decoding serves text models" in clean_error(capsys, [*generate, *flags])


def test_an_image_too_large_for_the_context_is_named(vlm_dir, tmp_path, capsys):
    image = tmp_path / "wide.png"
    Image.new("RGB", (28 * 600, 28)).save(image)  # 512 patches per side at most: 256 image tokens
    error = clean_error(capsys, ["generate", "-c", vlm_dir, "--prompt", "hi", "--image", image])
    assert "(256 of them from its image)" in error
    assert "the image is too large for this model's context" in error
    assert "at most" not in error


def test_transparency_reaches_the_processor_and_lands_on_white(vlm_dir, small_tokenizer, tmp_path):
    from k2lab.cli.infer import _image_prompts
    from k2lab.model_dir import load_model

    image = tmp_path / "clear.png"
    Image.new("RGBA", (28, 28), (0, 0, 0, 0)).save(image)  # fully transparent black: white once composited
    _, media = _image_prompts(load_model(vlm_dir), small_tokenizer, [image], ["hi"])
    assert torch.all(media["pixel_values"] == 1)


def test_serve_says_the_vision_tower_is_not_served(vlm_dir, capsys, monkeypatch):
    monkeypatch.setattr("k2lab.serve.listen.serve_on", lambda app, sock: None)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "-c", str(vlm_dir), "--compile", "off", "--port", "0"])
    assert exit_info.value.code == 0
    assert "its vision tower is not served (text only)" in capsys.readouterr().out
