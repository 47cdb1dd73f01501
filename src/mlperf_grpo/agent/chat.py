"""The conversation as token ids: the first prompt, and the environment's text between
two model turns, both rendered by the tokenizer's chat template. Earlier turns are never
re-rendered or re-tokenised: each turn's environment text is rendered on its own and
tokenised alone (the model's sampled ids stay exactly as sampled).

How the environment text is found (the technique of verl's and SkyRL's multi-turn
rollouts): render a fixed conversation ending with an assistant turn, once without and
once with the new messages and the generation prompt; the difference is what the template
writes after the assistant's ``<|im_end|>``. With the Qwen3 template, for two tool outputs::

    \\n<|im_start|>user\\n<tool_response>\\nOUT1\\n</tool_response>\\n<tool_response>\\nOUT2\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n
"""

from __future__ import annotations

import threading

from transformers import PreTrainedTokenizerBase

_ANCHOR = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ChatTokens:
    """Renders and tokenises the prompt and the environment's messages of one chat format.

    Args:
        tokenizer: the model's tokenizer with a chat template (Qwen3: ``builtin:swe-tiny``).
        tools: the tool schemas the system turn lists.
        end_of_turn: the token that ends a model turn (``<|im_end|>``), which the
            template writes after an assistant message.
        template_kwargs: passed to ``apply_chat_template`` (``enable_thinking=False``).
    Raises:
        ValueError: the tokenizer has no chat template or no ``end_of_turn`` token, or its assistant turn does not end
            with ``end_of_turn`` followed by text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict], end_of_turn: str = "<|im_end|>",
                 template_kwargs: dict | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; the agent needs one (model.path: builtin:swe-tiny)")
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self.tools = tools
        self.end_of_turn = end_of_turn
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
        if self.end_of_turn_id is None or self.end_of_turn_id == tokenizer.unk_token_id:
            raise ValueError(f"the model's tokenizer has no {end_of_turn} token; the agent needs one "
                             "(model.path: builtin:swe-tiny)")
        self.kwargs = dict(template_kwargs or {})
        self._base = self._render(_ANCHOR, generation_prompt=False)
        cut = self._base.rfind(end_of_turn)
        if cut < 0 or not self._base[:cut].endswith("a"):
            raise ValueError(f"the chat template does not end an assistant turn with {end_of_turn}")
        self._after_turn = cut + len(end_of_turn)  # where the template's text after <|im_end|> starts

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (special tokens as written, none added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def count(self, text: str) -> int:
        """How many tokens ``text`` is alone; safe on any thread (a fast tokenizer's Rust
        ``encode``: the ``__call__`` of :meth:`encode` sets truncation first, which fails
        when two threads do it at once)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            with self._lock:
                return len(self.encode(text))
        return len(backend.encode(text, add_special_tokens=False).ids)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: ``messages`` (system, user) with the tools and the generation prompt."""
        return self.encode(self._render(messages, generation_prompt=True))

    def environment_text(self, messages: list[dict]) -> str:
        """The text that follows a model turn's ``<|im_end|>``: ``messages`` (``tool``
        outputs, or a ``user`` message) and the next generation prompt."""
        full = self._render(_ANCHOR + messages, generation_prompt=True)
        if not full.startswith(self._base[:self._after_turn]):
            raise ValueError("the chat template renders earlier turns differently once more messages follow")
        return full[self._after_turn:]

    def environment_ids(self, messages: list[dict]) -> list[int]:
        """:meth:`environment_text` as token ids, tokenised alone."""
        return self.encode(self.environment_text(messages))
