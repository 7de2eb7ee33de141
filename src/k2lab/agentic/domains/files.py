"""The files domain: a workspace of text files.

World section ``files``: ``files`` (relative path -> text), ``readme.txt`` and ``todo.txt`` to begin with.
Tasks: write a file (the listing maybe asked for afterwards), append to ``todo.txt``, copy ``readme.txt``
(a read whose result the write needs), read ``readme.txt``, delete ``todo.txt``. Checks:
``file_contains``, ``file_absent``.
"""

from __future__ import annotations

import random
from typing import Any

from k2lab.agentic.domains.base import BaseTool, Domain, Draft, Param, Phase, Step, ToolError, string

__all__ = ["DOMAIN", "PHRASES"]

#: Texts that tasks write, append or put into ``readme.txt``.
PHRASES = ("ship the beta on friday", "call the plumber", "remember the milk", "draft the Q3 report")


def initial_state(rng: random.Random) -> dict[str, Any]:
    """Two files: ``readme.txt`` and ``todo.txt``."""
    return {"files": {"readme.txt": "hello", "todo.txt": "buy milk"}}


# ------------------------------------------------------------------------------------------------ tools


def _path(args: dict[str, Any]) -> str:
    path = str(args["path"]).strip()
    if not path or ".." in path or path.startswith("/"):
        raise ToolError("invalid_path", f"invalid path {path!r}")
    return path


def write_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    world["files"]["files"][path] = str(args["text"])
    return {"path": path, "bytes": len(str(args["text"]).encode())}


def read_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    if path not in world["files"]["files"]:
        raise ToolError("file_not_found", f"no such file {path!r}")
    return {"path": path, "text": world["files"]["files"][path]}


def append_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    files = world["files"]["files"]
    if path not in files:
        raise ToolError("file_not_found", f"no such file {path!r}")
    files[path] += str(args["text"])
    return {"path": path, "bytes": len(files[path].encode())}


def list_files(world: dict[str, Any], args: dict[str, Any]) -> Any:
    return {"files": sorted(world["files"]["files"])}


def delete_file(world: dict[str, Any], args: dict[str, Any]) -> Any:
    path = _path(args)
    if world["files"]["files"].pop(path, None) is None:
        raise ToolError("file_not_found", f"no such file {path!r}")
    return {"deleted": path}


PATH = Param(
    "path", string("Relative file path, e.g. 'notes.txt'."), synonyms=("filename", "file_path", "file_name")
)
TEXT = Param("text", string("Text to write."), synonyms=("content", "body", "data"))

TOOLS: tuple[BaseTool, ...] = (
    BaseTool("write_file", "files", "io", "Create or overwrite a text file.", (PATH, TEXT), write_file,
             aliases=("save_file", "create_file", "put_file")),
    BaseTool("read_file", "files", "io", "Read a text file.", (PATH,), read_file, True,
             aliases=("open_file", "get_file", "cat_file")),
    BaseTool("append_file", "files", "io", "Append text to an existing file.", (PATH, TEXT), append_file,
             aliases=("append_text", "add_to_file", "file_append")),
    BaseTool("list_files", "files", "directory", "List the files.", (), list_files, True, "files",
             ("ls", "dir_listing", "show_files")),
    BaseTool("delete_file", "files", "directory", "Delete a file.", (PATH,), delete_file,
             aliases=("remove_file", "rm_file", "erase_file")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tasks


def files_write(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Write a new file (the file listing maybe asked for after)."""
    path, text = rng.choice(("notes.txt", "plan.md", "ideas.txt", "report.txt")), rng.choice(PHRASES)
    steps = [Step("write_file", {"path": path, "text": text})]
    phases = [Phase(f"Create {path} containing: {text}", steps, f"Saved {path} with your text.")]
    if rng.random() < 0.35:
        names = sorted({*world["files"]["files"], path})
        phases.append(
            Phase(
                "Which files do I have now?",
                [Step("list_files")],
                f"Your files: {', '.join(names)}.",
                terms=names,
            )
        )
    check = {"kind": "file_contains", "path": path, "text": text, "description": f"{path} contains '{text}'"}
    return Draft("files_write", phases, [check])


def files_append(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Append a phrase to todo.txt."""
    text = "; " + rng.choice(PHRASES)
    original = world["files"]["files"]["todo.txt"]
    steps = [Step("append_file", {"path": "todo.txt", "text": text})]
    phase = Phase(
        f"Add '{text[2:]}' to the end of todo.txt, after a '; '.", steps, "Appended it to todo.txt."
    )
    check = {
        "kind": "file_contains",
        "path": "todo.txt",
        "text": original + text,
        "description": f"todo.txt reads '{original + text}'",
    }
    return Draft("files_append", [phase], [check])


def files_copy(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Read one file and write its text to another: the second call depends on the first's result."""
    text = rng.choice(PHRASES)
    world["files"]["files"]["readme.txt"] = text
    target = rng.choice(("backup.txt", "readme_copy.txt", "archive/readme.txt"))
    steps = [Step("read_file", {"path": "readme.txt"}), Step("write_file", {"path": target, "text": text})]
    phase = Phase(
        f"Make a copy of readme.txt at {target}.", steps, f"Copied readme.txt to {target}.", terms=[target]
    )
    check = {
        "kind": "file_contains",
        "path": target,
        "text": text,
        "description": f"{target} holds readme's text",
    }
    return Draft("files_copy", [phase], [check])


def files_read(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Report what readme.txt says."""
    text = rng.choice(PHRASES)
    world["files"]["files"]["readme.txt"] = text
    steps = [Step("read_file", {"path": "readme.txt"})]
    phase = Phase("What does readme.txt say?", steps, f"readme.txt says: {text}", terms=[text])
    return Draft(
        "files_read", [phase], [{"kind": "unchanged", "section": "files", "description": "no file changed"}]
    )


def files_delete(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Delete todo.txt."""
    steps = [Step("delete_file", {"path": "todo.txt"})]
    phase = Phase("Delete todo.txt, I don't need it anymore.", steps, "Deleted todo.txt.")
    return Draft(
        "files_delete",
        [phase],
        [{"kind": "file_absent", "path": "todo.txt", "description": "todo.txt is gone"}],
    )


# ----------------------------------------------------------------------------------------------- checks


def _file_contains(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    text = world["files"]["files"].get(check["path"])
    if text is None:
        return f"{check['path']} does not exist"
    return None if check["text"] in text else f"{check['path']} does not contain {check['text']!r}"


def _file_absent(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    return f"{check['path']} still exists" if check["path"] in world["files"]["files"] else None


DOMAIN = Domain(
    name="files",
    description="a workspace of text files",
    prefixes=("fs_", "doc_", "drive_", "vault_"),
    tools=TOOLS,
    templates=(files_write, files_append, files_copy, files_read, files_delete),
    initial_state=initial_state,
    checks={"file_contains": _file_contains, "file_absent": _file_absent},
)
