"""k2lab.allocator: the glibc setting is applied in a fresh process and can be turned off."""

import os
import subprocess
import sys

import pytest

CHECK = (
    "import k2lab.allocator as a; first = a.keep_freed_memory(); print(first, a.keep_freed_memory() == first)"
)


def run(env_value: str | None) -> str:
    env = {} if env_value is None else {"K2LAB_MALLOC": env_value}
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_applied_once_and_idempotent():
    assert run(None) == "True True"


def test_default_keeps_glibc_behaviour():
    assert run("default") == "False True"
