"""k2lab's chat format as a Jinja chat template (``chat_template.jinja``, package data beside this module).

The template is the Jinja twin of ``k2lab.runtime.chat.render_chat``: for every conversation that
``render_chat`` accepts, transformers' ``tokenizer.apply_chat_template(messages, tools=tools,
add_generation_prompt=g, tokenize=False)`` gives byte-identical text (``tests/hf/test_chat_template.py``
checks it over generated conversations). Rendered as ``render_chat`` does:

* the ``tool_declare`` system turn first when ``tools`` is non-empty: TypeScript as
  ``k2lab.runtime.tool_spec.tools_to_typescript`` writes it (descriptions as ``//`` comments, ``?`` for
  optional properties, unions, ``T[]`` with ``(A | B)[]`` for compound items, inline ``$ref``,
  ``// default:`` comments), or compact JSON with the template variable ``tool_format="json"``;
* ``developer`` turns as ``system``; content as a string or a list of text parts (joined);
* an image part (``image`` / ``image_url``) as
  ``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`` in place, which ``Kimi_K25Processor``
  widens to the image's tokens: then the text is that of ``k2lab.vision.chat.render_multimodal_chat``
  (``render_chat`` itself refuses images); a video part (``video`` / ``video_url``) raises (transformers'
  ``raise_exception``): its blocks depend on its frames, which a template does not see;
* assistant turns ``[<think>{reasoning_content}</think>]{content}[tool-call section]`` with tool calls
  renumbered ``functions.{name}:{idx}`` through the conversation and tool results' ``tool_call_id``
  rewritten to the id of the call they answer (the latest call with that client id); arguments given as
  an object are dumped as ``json.dumps(..., ensure_ascii=False)`` (transformers' ``tojson``);
* the generation prompt ``<|im_assistant|>assistant<|im_middle|>`` (no ``<think>`` opened).

What Jinja does not do: ``render_chat`` *rejects* some inputs with ``ChatFormatError`` (special-token
strings in text, ``</think>`` inside reasoning, an invalid tool spec, a missing user content ...); the
template renders them anyway (it validates nothing), so equality holds on the inputs ``render_chat``
accepts. There is no thinking switch: like ``render_chat``, a turn shows ``<think>`` exactly when it has
``reasoning_content``.

K3-family models (``k2lab.runtime.chat_format.chat_format_for``: with the XTML tokens) get
``chat_template_k3.jinja`` instead, the twin of ``k2lab.runtime.chat_k3.render_chat_k3`` (K3's XTML format;
byte-identical on the conversations it accepts whose tool-call arguments are objects; template variables
``thinking``, ``thinking_effort``, ``tool_choice``; image and video parts as above, the image block being
what K3's engines widen). K3 binds a tool result to its call by position only, so where ``render_chat_k3``
refuses results it cannot carry (one answering no call of the assistant turn right before it, results not
answering calls 1..k once each), an unknown role or a ``thinking_effort`` other than low / high / max, the K3
template raises as well (transformers' ``raise_exception``, which vLLM and SGLang reach through
``tokenizer.apply_chat_template``; same message) rather than render the conversation with a result left out.
K2 names a result's call by id, and both K2 renderers keep a result that answers no call.
``chat_template_for(config)`` picks by the model's family (or takes the chat format chosen already).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources

from k2lab.config import ModelConfig
from k2lab.runtime.chat_format import ChatFormat, chat_format_for

__all__ = ["TEMPLATE_FILE", "TEMPLATE_FILE_K3", "chat_template", "chat_template_for", "chat_template_k3"]

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_FILE_K3 = "chat_template_k3.jinja"


def _packaged(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def chat_template() -> str:
    """K2's template's text (read from the installed package's data)."""
    return _packaged(TEMPLATE_FILE)


def chat_template_k3() -> str:
    """K3's template's text."""
    return _packaged(TEMPLATE_FILE_K3)


def chat_template_for(config: ModelConfig | ChatFormat, special: Mapping[str, int] | None = None) -> str:
    """The template of a chat format: ``config``'s own, or the one a model of ``config`` (with a tokenizer of
    these ``special`` tokens) speaks (``k2lab.runtime.chat_format.chat_format_for``, which warns when a
    K3-family model's tokenizer lacks the XTML tokens; pass the format when it is chosen already)."""
    chat_format = config if isinstance(config, ChatFormat) else chat_format_for(config, special=special)
    return chat_template_k3() if chat_format.family == "k3" else chat_template()
