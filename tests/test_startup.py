"""What a process pays before its first token or step: the CLI, a loaded model, a generation and an
optimizer's steps and state dict must not import ``torch._dynamo``, sympy or ``torch.distributed.tensor``
(together 4–5 s of every start on the 2-core VM) unless something compiles or shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from k2lab import build_model, load_preset
from k2lab.model_dir import save_model

HEAVY = ("torch._dynamo", "sympy", "torch.distributed.tensor")

SCRIPT = """
import json, sys
import k2lab.cli.app
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.model_dir import load_model
from k2lab.presets.vision_language import load_vlm_preset, vlm_parameter_counts
from k2lab.params import count_parameters
from k2lab import build_model, load_preset
seen = {"cli": [m for m in HEAVY if m in sys.modules]}
model = load_model(sys.argv[1])
generate(model, [[1, 5, 6]], GenerationConfig(max_new_tokens=3))
with __import__("torch").no_grad():
    model(__import__("torch").tensor([[1, 2, 3]]))
seen["load+generate"] = [m for m in HEAVY if m in sys.modules]
build_model(load_preset("k2"), device="meta")
build_model(load_preset("k3"), device="meta")
vlm_parameter_counts(load_vlm_preset("k25"))
seen["meta presets"] = [m for m in HEAVY if m in sys.modules]
from k2lab.optim.muon import Muon
matrices = [p for p in model.parameters() if p.dim() > 1]
others = [p for p in model.parameters() if p.dim() == 1]
optimizer = Muon([{"params": matrices}, {"params": others, "kind": "adamw"}], lr=1e-3)
for _ in range(2):
    model(__import__("torch").tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
optimizer.load_state_dict(optimizer.state_dict())
seen["optimizer"] = [m for m in HEAVY if m in sys.modules]
print(json.dumps(seen))
"""


def test_loading_and_generating_import_no_compiler_or_dtensor(tmp_path: Path) -> None:
    save_model(build_model(load_preset("k2-nano")), tmp_path / "model")
    script = f"HEAVY = {HEAVY!r}\n" + SCRIPT
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "model")], capture_output=True, text=True, check=True
    )
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"cli": [], "load+generate": [], "meta presets": [], "optimizer": []}
