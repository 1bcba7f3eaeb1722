"""Prompt templates (spec rewards-and-eval.md §10): question -> the exact model input text.

Templates are a confound: compare methods only under the same template. The Qwen-style
templates are rendered from our own strings (ChatML), not from the tokenizer's chat template,
whose built-in system prompt is not pinned down; ``chat`` uses the tokenizer's template.

Prompts are tokenized later with ``add_special_tokens=False`` (a chat template writes its own
special tokens), so a tokenizer that puts a BOS token first (Llama style) gets it here, as
text, unless the template already wrote it. A ChatML template on a tokenizer without the ChatML
tokens would be split into characters the model never saw in that role: it is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# understand-r1-zero ``r1`` template: plain text, no chat markup, the assistant turn opened.
_R1_INSTRUCTION = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <think> "
    "</think> and answer is enclosed within <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)


def _chatml(system: str, user: str) -> str:
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _raw(question: str, tokenizer: Any) -> str:
    return question


def _chat(question: str, tokenizer: Any, system_prompt: str | None = None) -> str:
    if tokenizer is None or getattr(tokenizer, "chat_template", "") is None:
        raise ValueError("template 'chat' needs a tokenizer with a chat template")
    messages = [{"role": "user", "content": question}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja's TemplateError, e.g. "System role not supported"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"the tokenizer's chat template failed: {first}") from None


def _qwen_math_cot(question: str, tokenizer: Any) -> str:
    return _chatml(_BOXED_INSTRUCTION, question)


def _qwen_boxed(question: str, tokenizer: Any) -> str:
    return _chatml("You are a helpful assistant.", f"{question}\n{_BOXED_INSTRUCTION}")


def _essa_math(question: str, tokenizer: Any) -> str:
    return _chatml("Please reason step by step and place your final answer in \\boxed{}", question)


def _r1(question: str, tokenizer: Any) -> str:
    return f"{_R1_INSTRUCTION}\nUser: {question}\nAssistant: <think>"


# Tool-integrated reasoning (ToRL's format, the tools.python defaults): the system turn says
# how to run Python and how to state the answer (essa.data.tool_sft writes SFT targets so).
PYTHON_TOOL_INSTRUCTION = (
    "You can run Python. Write code in a ```python block; it runs, and what it prints appears "
    "in an ```output block after it. Then state the final answer as: The answer is <answer>."
)


def _python_tool(question: str, tokenizer: Any) -> str:
    return _chat(question, tokenizer, PYTHON_TOOL_INSTRUCTION)


def _auto(question: str, tokenizer: Any) -> str:
    return TEMPLATES[resolve_template("auto", tokenizer)](question, tokenizer)


# name -> render(question, tokenizer); see render_prompt for each template's source.
TEMPLATES: dict[str, Callable[[str, Any], str]] = {
    "auto": _auto,
    "raw": _raw,
    "chat": _chat,
    "qwen_math_cot": _qwen_math_cot,
    "qwen_boxed": _qwen_boxed,
    "essa_math": _essa_math,
    "r1": _r1,
    "python_tool": _python_tool,
}


CHATML_TEMPLATES = ("qwen_math_cot", "qwen_boxed", "essa_math")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def _has_token(tokenizer: Any, token: str) -> bool:
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and token_id != tokenizer.unk_token_id


def resolve_template(template: str, tokenizer: Any) -> str:
    """``auto`` -> ``chat`` for a tokenizer with a chat template, else ``raw``; others as given."""
    if template != "auto":
        return template
    has_chat = tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None
    return "chat" if has_chat else "raw"


def check_template(template: str, tokenizer: Any, system_prompt: str | None = None) -> None:
    """Refuse, in one line, a template this tokenizer cannot render as its model expects."""
    if template not in TEMPLATES:
        raise ValueError(
            f"unknown prompt template {template!r}; known: {', '.join(known_templates())}"
        )
    if template == "auto" and system_prompt is not None:
        if resolve_template(template, tokenizer) != "chat":
            raise ValueError(
                "data.system_prompt needs a chat template; template 'auto' found none in the "
                "tokenizer and renders the question raw"
            )
        return
    if system_prompt is not None and template != "chat":
        raise ValueError(
            f"data.system_prompt applies to template 'chat' only; template {template!r} has "
            "its own fixed prompt"
        )
    if template in ("chat", "python_tool") and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"template {template!r} needs a tokenizer with a chat template, and this one has "
            "none (use template 'auto' or 'raw')"
        )
    if template in CHATML_TEMPLATES and tokenizer is not None:
        missing = [t for t in CHATML_TOKENS if not _has_token(tokenizer, t)]
        if missing:
            raise ValueError(
                f"template {template!r} writes ChatML, but the tokenizer has no "
                f"{' or '.join(missing)} token; use template 'chat' (the model's own) or 'raw'"
            )


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts its BOS token first when encoding with special tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if tokenizer is None or bos is None:
        return False
    return tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]


def with_bos(text: str, tokenizer: Any) -> str:
    """``text`` with the tokenizer's BOS token in front when it needs one and lacks it."""
    if adds_bos(tokenizer) and not text.startswith(tokenizer.bos_token):
        return tokenizer.bos_token + text
    return text


def known_templates() -> list[str]:
    """Registered template names, sorted."""
    return sorted(TEMPLATES)


def render_prompt(
    template: str, question: str, tokenizer: Any = None, system_prompt: str | None = None
) -> str:
    """The model input for ``question`` under ``template``:

    - ``auto``: ``chat`` when the tokenizer has a chat template, else ``raw``;
    - ``raw``: the question unchanged (toy tasks, e.g. ``"12+30="``);
    - ``chat``: ``tokenizer.apply_chat_template`` on one user turn (after a system turn
      holding ``system_prompt``, when given) with ``add_generation_prompt=True`` (the caller
      passes the tokenizer);
    - ``qwen_math_cot``: Qwen2.5-Math CoT, ChatML with the system prompt "Please reason step by
      step, and put your final answer within \\boxed{}.";
    - ``qwen_boxed``: Qwen2-Math, system "You are a helpful assistant.", the boxed instruction
      after the question in the user turn;
    - ``essa_math``: ChatML with the ESSA paper's system prompt (App. H.1);
    - ``r1``: understand-r1-zero plain-text R1 prompt ending in ``"Assistant: <think>"``;
    - ``python_tool``: ``chat`` with a system turn saying the model may run Python in ToRL's
      code and output blocks and how to state the answer (tool-integrated rollouts).

    >>> render_prompt("qwen_math_cot", "1+1?").splitlines()[2:4]
    ['<|im_start|>user', '1+1?<|im_end|>']
    """
    check_template(template, tokenizer, system_prompt)
    template = resolve_template(template, tokenizer)
    if template == "chat":
        text = _chat(question, tokenizer, system_prompt)
    else:
        text = TEMPLATES[template](question, tokenizer)
    return with_bos(text, tokenizer)


def render_prompts(
    template: str, questions: list[str], tokenizer: Any = None, system_prompt: str | None = None
) -> list[str]:
    """:func:`render_prompt` of each question, the tokenizer checked once."""
    check_template(template, tokenizer, system_prompt)
    template = resolve_template(template, tokenizer)
    bos = tokenizer.bos_token if adds_bos(tokenizer) else None
    texts = []
    for question in questions:
        if template == "chat":
            text = _chat(question, tokenizer, system_prompt)
        else:
            text = TEMPLATES[template](question, tokenizer)
        texts.append(bos + text if bos is not None and not text.startswith(bos) else text)
    return texts
