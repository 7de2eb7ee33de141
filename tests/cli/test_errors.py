"""The command line: exit code 2 and one readable paragraph for bad input, never a traceback."""

import subprocess
import sys

import pytest

from k2lab.cli import main


def k2lab(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "k2lab", *args], capture_output=True, text=True, cwd=cwd)


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in " ".join(result.stderr.split())


def test_unknown_preset_lists_available():
    assert_clean_error(k2lab("params", "--preset", "k9"), "unknown preset 'k9'", "k2-mini")


def test_init_then_generate(tmp_path):
    out = tmp_path / "nano"
    assert k2lab("init", "--preset", "k2-nano", "--out", str(out)).returncode == 0
    result = k2lab(
        "generate", "--checkpoint", str(out), "--prompt", "1 2 3", "--prompt", "4,5", "--max-new-tokens", "4"
    )
    assert result.returncode == 0, result.stderr
    assert "prompt [1, 2, 3] ->" in result.stdout and "prompt [4, 5] ->" in result.stdout
    too_long = ["generate", "--checkpoint", str(out), "--prompt", "1 2 3", "--max-new-tokens", "100000"]
    assert_clean_error(k2lab(*too_long), "pass the model's context")  # ran on for minutes, past the context


@pytest.mark.parametrize(
    ("setup", "fragments"),
    [
        ("missing", ["does not exist"]),
        ("empty", ["neither"]),
        ("bad-json", ["not valid JSON"]),
        ("truncated", ["cannot be read"]),
    ],
)
def test_bad_checkpoints(tmp_path, setup, fragments):
    path = tmp_path / "ckpt"
    if setup != "missing":
        path.mkdir()
    if setup == "bad-json":
        (path / "k2lab.json").write_text("{not json")
    if setup == "truncated":
        assert k2lab("init", "--preset", "k2-nano", "--out", str(path)).returncode == 0
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    assert_clean_error(k2lab("generate", "--checkpoint", str(path), "--prompt", "1"), *fragments)


def test_invalid_values(tmp_path):
    assert k2lab("init", "--preset", "k2-nano", "--out", str(tmp_path / "n")).returncode == 0
    assert_clean_error(k2lab("generate", "-c", str(tmp_path / "n"), "--prompt", "a b"), "no tokenizer.json")
    assert_clean_error(k2lab("generate", "-c", str(tmp_path / "n"), "--prompt", "1", "--top-p", "2"), "top_p")
    assert_clean_error(
        k2lab("generate", "-c", str(tmp_path / "n"), "--prompt", "500"), "outside the model's vocabulary"
    )


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path):
    """The library's check (``check_draft``), before the draft could be left unused."""
    from k2lab import build_model, load_preset
    from k2lab.model_dir import save_model

    save_model(build_model(load_preset("k2-nano")), tmp_path / "target")
    save_model(build_model(load_preset("k2-nano", vocab_size=64)), tmp_path / "draft")
    args = ["generate", "-c", str(tmp_path / "target"), "--prompt", "1 2", "--draft", str(tmp_path / "draft")]
    assert_clean_error(k2lab(*args), "the draft model's vocabulary has 64 tokens, the target's 128")


def test_init_refuses_full_size_presets(tmp_path):
    assert_clean_error(k2lab("init", "--preset", "k2", "--out", str(tmp_path / "k2")), "k2lab params")


def test_stability_json_shows_clip_holding_tau():
    result = k2lab("stability", "--optimizer", "muonclip", "--qk-clip-tau", "3", "--steps", "20", "--json")
    assert result.returncode == 0, result.stderr
    import json

    steps = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(steps) == 20 and all(s["max_logit_clipped"] <= 3 * (1 + 1e-6) for s in steps)
    assert any(s["qk_clipped_heads"] > 0 for s in steps)


def test_stability_table_names_tau_only_where_it_clips():
    without = k2lab("stability", "--optimizer", "adamw", "--steps", "2")
    assert without.returncode == 0, without.stderr
    assert "(no QK-Clip)" in without.stdout and "τ" not in without.stdout  # was: "τ 5.0", never applied
    clipped = k2lab("stability", "--optimizer", "muonclip", "--steps", "2")
    assert "τ 5.0" in clipped.stdout and "no QK-Clip" not in clipped.stdout


def test_presets_table_shows_the_layer_mix():
    result = subprocess.run(
        [sys.executable, "-m", "k2lab", "presets"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "200", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│")}
    assert "93 (24 / 69)" in rows["k3"] and "2.78T" in rows["k3"]
    assert "27 (7 / 20)" in rows["kimi-linear-48b-a3b"]
    assert "61 (61 / 0)" in rows["k2"]


def test_errors_keep_long_paths_on_one_line_and_brackets_as_text(tmp_path, capsys):
    """An error naming a path longer than the terminal prints it unbroken (rich wrapped it at 80 columns
    under capture), and brackets in a message are text, not rich markup (``[vision]`` was swallowed)."""
    missing = tmp_path / ("d" * 120) / "nothing"
    with pytest.raises(SystemExit) as done:
        main(["export", str(missing), "--out", str(tmp_path / "x")])
    assert done.value.code == 2
    assert f"{missing} does not exist" in capsys.readouterr().err
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('preset = "k2-nano"\n[vision]\n')
    with pytest.raises(SystemExit) as done:
        main(["train", "--recipe", str(recipe), "--out", str(tmp_path / "run")])
    assert done.value.code == 2
    assert "[vision] needs a vision-language preset" in capsys.readouterr().err


def test_writers_refuse_to_replace_a_directory_of_other_files(tmp_path):
    """`init -o` and `export -o` replace their output directory whole: onto a directory of other files, or
    onto (or above) the source itself, they refuse and delete nothing; an earlier model there is replaced."""
    mixed = tmp_path / "mixed"
    (mixed / "sub").mkdir(parents=True)
    (mixed / "precious.txt").write_text("keep")
    for extra in ([], ["--hf"]):
        assert_clean_error(
            k2lab("init", "--preset", "k2-nano", "--out", str(mixed), *extra), "holds other files"
        )
    model = tmp_path / "model"
    assert k2lab("init", "--preset", "k2-nano", "--out", str(model)).returncode == 0
    assert k2lab("init", "--preset", "k2-nano", "--out", str(model), "--seed", "1").returncode == 0  # a model
    for out in (model, tmp_path):
        assert_clean_error(k2lab("export", str(model), "--out", str(out)), "holds the source")
    assert_clean_error(k2lab("export", str(model), "--out", str(mixed)), "holds other files")
    assert_clean_error(k2lab("export", str(model), "--out", str(mixed), "--format", "gguf"), "is a directory")
    assert sorted(p.name for p in mixed.iterdir()) == ["precious.txt", "sub"]
    assert (model / "k2lab.json").is_file()
    (mixed / "config.json").write_text('{"name": "web app"}')  # not a model's: the directory is kept
    assert_clean_error(k2lab("init", "--preset", "k2-nano", "--out", str(mixed)), "holds other files")
    weights = (model / "model.safetensors").read_bytes()
    gguf = ["--format", "gguf"]
    assert_clean_error(
        k2lab("export", str(model), "--out", str(model / "model.safetensors"), *gguf), "inside the source"
    )
    assert_clean_error(
        k2lab("export", str(model), "--out", str(mixed / "precious.txt"), *gguf), "is not a GGUF file"
    )
    assert (model / "model.safetensors").read_bytes() == weights and (
        mixed / "precious.txt"
    ).read_text() == "keep"
    new_dir = tmp_path / "new"  # "new/" names a directory: no file called new appears
    assert_clean_error(k2lab("export", str(model), "--out", f"{new_dir}/", *gguf), "names a directory")
    assert not new_dir.exists()


def test_unreadable_recipes_and_run_directories_get_one_line(tmp_path):
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00x")
    (tmp_path / "afile").write_text("")
    assert_clean_error(k2lab("train", "--recipe", str(tmp_path)), "cannot be read")
    assert_clean_error(k2lab("train", "--recipe", str(tmp_path / "bin.toml")), "is not UTF-8")
    small = ["--preset", "k2-nano", "--steps", "2"]
    assert_clean_error(k2lab("train", *small, "--out", str(tmp_path / "afile")), "is not a directory")
    assert_clean_error(k2lab("train", *small, "--out", str(tmp_path / "afile" / "run")), "cannot make")


def test_resuming_a_complete_or_another_run_changes_nothing(tmp_path):
    """--resume on a run already at its last step said "validation loss nan" and wrote NaN into its
    summary.json (not even JSON); now it says the run is complete and leaves everything as it was. Resumed
    with another optimizer or preset, one line names the mismatch (was torch's traceback)."""
    run = tmp_path / "run"
    args = ["train", "--preset", "k2-nano", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
            "--save-every", "1", "--out", str(run)]  # fmt: skip
    assert k2lab(*args).returncode == 0
    summary = (run / "summary.json").read_bytes()
    assert_clean_error(k2lab(*args, "--resume"), "already complete at step 2")
    assert (run / "summary.json").read_bytes() == summary
    further = [*args[:4], "3", *args[5:], "--resume"]  # --steps 3
    assert_clean_error(
        k2lab(*further, "--optimizer", "adamw"), "optimizer.name: 'muonclip' then, 'adamw' now"
    )
    mismatched = [arg if arg != "k2-nano" else "k3-nano" for arg in further]
    assert_clean_error(k2lab(*mismatched), "preset: 'k2-nano' then, 'k3-nano' now")


def test_ctrl_c_says_where_the_run_stands(tmp_path):
    """Ctrl-C during training exits 130 (interrupted) and names the checkpoint --resume continues from
    (it said nothing, and the steps after the last save were silently lost)."""
    import signal
    import time

    run = tmp_path / "run"
    args = ["train", "--preset", "k2-nano", "--steps", "100000", "--batch-size", "2", "--seq-len", "32",
            "--save-every", "5", "--out", str(run)]  # fmt: skip
    # SIGINT as a terminal leaves it: a pytest-xdist worker ignores it, and Python started with SIGINT ignored
    # installs no KeyboardInterrupt handler, so the child would train on
    process = subprocess.Popen(
        [sys.executable, "-m", "k2lab", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 120
    while not (run / "checkpoints").is_dir() or not any((run / "checkpoints").glob("step_*")):
        assert time.time() < deadline and process.poll() is None, "no checkpoint written"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output[-2000:]
    assert "interrupted:" in output and "its last checkpoint, step" in output and "--resume" in output


def test_training_commands_keep_foreign_directories_and_their_sources(tmp_path):
    """train / sft / rl into a directory of other files, or into the run they read from, wiped it (model/
    replaced whole, metrics and samples overwritten); now one line and nothing touched."""
    victim = tmp_path / "victim"
    (victim / "model").mkdir(parents=True)
    (victim / "model" / "weights.bin").write_text("precious")
    small = ["--preset", "k2-nano", "--steps", "1", "--batch-size", "2", "--seq-len", "16"]
    assert_clean_error(k2lab("train", *small, "--out", str(victim)), "not a k2lab run directory")
    assert_clean_error(k2lab("train", *small, "--out", ""), "is empty")
    assert [p.name for p in victim.rglob("*")] == ["model", "weights.bin"]
    model = tmp_path / "run" / "model"
    assert k2lab("init", "--preset", "k2-nano", "--out", str(model)).returncode == 0
    (model / "tokenizer.json").write_text("{}")  # rl checks for it before the run directory
    before = (model / "model.safetensors").read_bytes()
    for out in (model.parent, model):
        assert_clean_error(k2lab("rl", "-c", str(model), "--out", str(out)), "which this run reads")
        assert_clean_error(
            k2lab("sft", "-c", str(model), "--data", "x.jsonl", "--out", str(out)), "which this run reads"
        )
    assert (model / "model.safetensors").read_bytes() == before


def test_a_one_file_corpus_says_why_it_cannot_validate(tmp_path):
    """Files go to validation whole: a one-file corpus trained its tokenizer, then failed with "validation split
    has 0 tokens"; now it says why before any work."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "data.jsonl").write_text("".join(f'{{"text": "doc {i} hello world"}}\n' for i in range(200)))
    small = ["--preset", "k2-nano", "--steps", "1", "--batch-size", "2", "--seq-len", "16"]
    result = k2lab("train", *small, "--data", str(corpus), "--out", str(tmp_path / "run"))
    assert_clean_error(result, "has no validation text", "holds 1 file;")
    assert "tokenizer" not in result.stdout.lower()


def test_serve_and_rl_say_a_missing_checkpoint_does_not_exist(tmp_path):
    """They said "has no tokenizer.json" of a directory that is not there."""
    missing = str(tmp_path / "nowhere")
    assert_clean_error(k2lab("serve", "-c", missing), "checkpoint directory", "does not exist")
    assert_clean_error(k2lab("rl", "-c", missing, "--out", str(tmp_path / "run")), "does not exist")


def test_one_process_commands_are_refused_under_torchrun(monkeypatch, capsys):
    """Under torchrun every rank ran `k2lab rl` (or mopd, serve, ablate ...) whole, into one run directory."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv in (["rl", "-c", "x", "--out", "y"], ["serve", "-c", "x"], ["ablate", "parl", "--quick"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        message = " ".join(capsys.readouterr().err.split())
        assert f"`k2lab {argv[0]}` runs in one process: under torchrun (WORLD_SIZE=2)" in message
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])  # no command: the help
    assert exit_info.value.code == 0


def test_init_replaces_only_a_checkpoint_init_could_have_written(tmp_path, capsys):
    """`init -o runs/a/model` replaced a trained model with random weights and deleted its tokenizer."""
    from k2lab.train.run_directory import RUN_MARKER

    def init(out):
        with pytest.raises(SystemExit) as exit_info:
            main(["init", "--preset", "k2-nano", "--out", str(out)])
        return exit_info.value.code

    out = tmp_path / "run" / "model"
    assert init(out) in (0, None) and init(out) in (0, None)  # an earlier init output: replaced
    (out / "tokenizer.json").write_text("{}")  # a trained model's directory
    weights = (out / "model.safetensors").read_bytes()
    assert init(out) == 2 and "no earlier `k2lab init` checkpoint" in " ".join(
        capsys.readouterr().err.split()
    )
    (out / "tokenizer.json").unlink()
    (tmp_path / "run" / RUN_MARKER).write_text("{}")  # a run's model/
    assert init(out) == 2 and (out / "model.safetensors").read_bytes() == weights


def test_token_ids_prompts_that_are_not_ids_say_why_ids_were_expected(tmp_path, small_tokenizer, capsys):
    """With --token-ids, the error said the checkpoint had no tokenizer.json, beside the one it has."""
    from k2lab import build_model, load_preset
    from k2lab.model_dir import save_model

    save_model(build_model(load_preset("k2-nano", vocab_size=300)), tmp_path / "m")
    small_tokenizer.save(tmp_path / "m" / "tokenizer.json")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "-c", str(tmp_path / "m"), "--token-ids", "--prompt", "abc"])
    error = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "--token-ids was given, so --prompt must be token ids" in error
    assert "no tokenizer.json" not in error
