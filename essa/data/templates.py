"""Prompt templates (spec rewards-and-eval.md §10): question -> the exact model input text.

Templates are a confound: compare methods only under the same template. The Qwen-style
templates are rendered from our own strings (ChatML), not from the tokenizer's chat template,
whose built-in system prompt is not pinned down; ``chat`` uses the tokenizer's template.
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


def _chat(question: str, tokenizer: Any) -> str:
    if tokenizer is None:
        raise ValueError("template 'chat' needs a tokenizer with a chat template")
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _qwen_math_cot(question: str, tokenizer: Any) -> str:
    return _chatml(_BOXED_INSTRUCTION, question)


def _qwen_boxed(question: str, tokenizer: Any) -> str:
    return _chatml("You are a helpful assistant.", f"{question}\n{_BOXED_INSTRUCTION}")


def _essa_math(question: str, tokenizer: Any) -> str:
    return _chatml("Please reason step by step and place your final answer in \\boxed{}", question)


def _r1(question: str, tokenizer: Any) -> str:
    return f"{_R1_INSTRUCTION}\nUser: {question}\nAssistant: <think>"


# name -> render(question, tokenizer); see render_prompt for each template's source.
TEMPLATES: dict[str, Callable[[str, Any], str]] = {
    "raw": _raw,
    "chat": _chat,
    "qwen_math_cot": _qwen_math_cot,
    "qwen_boxed": _qwen_boxed,
    "essa_math": _essa_math,
    "r1": _r1,
}


def known_templates() -> list[str]:
    """Registered template names, sorted."""
    return sorted(TEMPLATES)


def render_prompt(template: str, question: str, tokenizer: Any = None) -> str:
    """The model input for ``question`` under ``template``:

    - ``raw``: the question unchanged (toy tasks, e.g. ``"12+30="``);
    - ``chat``: ``tokenizer.apply_chat_template`` on one user turn with
      ``add_generation_prompt=True`` (the caller passes the tokenizer);
    - ``qwen_math_cot``: Qwen2.5-Math CoT, ChatML with the system prompt "Please reason step by
      step, and put your final answer within \\boxed{}.";
    - ``qwen_boxed``: Qwen2-Math, system "You are a helpful assistant.", the boxed instruction
      after the question in the user turn;
    - ``essa_math``: ChatML with the ESSA paper's system prompt (App. H.1);
    - ``r1``: understand-r1-zero plain-text R1 prompt ending in ``"Assistant: <think>"``.

    >>> render_prompt("qwen_math_cot", "1+1?").splitlines()[2:4]
    ['<|im_start|>user', '1+1?<|im_end|>']
    """
    render = TEMPLATES.get(template)
    if render is None:
        raise ValueError(
            f"unknown prompt template {template!r}; known: {', '.join(known_templates())}"
        )
    return render(question, tokenizer)
