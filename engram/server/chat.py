"""Chat prompts: the checkpoint's Jinja template (sandboxed, with transformers' variables) when it has one,
else ``<|role|>\\n{content}\\n`` per message, then ``<|assistant|>\\n`` for a generation prompt.
"""
from __future__ import annotations

from functools import lru_cache


def simple_template(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


@lru_cache(maxsize=4)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render_chat(messages: list[dict[str, str]], template: str | None, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for ``messages`` ([{"role", "content"}]). Raises ValueError for a broken template."""
    if not template:
        return simple_template(messages, add_generation_prompt)
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token)
    except Exception as e:  # jinja raises many types; the request gets a 400 naming the cause
        raise ValueError(f"the model's chat template failed to render: {e}") from e
