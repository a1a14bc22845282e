"""Text <-> token ids, chat templates and stop ids, over the `tokenizers` library (no transformers at run time)."""

from __future__ import annotations

import dataclasses
import functools

import jinja2
import jinja2.sandbox
import tokenizers

from treeserve.errors import TreeserveError


def _refuse(message):
    """A chat template's raise_exception(): the template refuses these messages."""
    raise TreeserveError(f"chat template: {message}")


@dataclasses.dataclass(frozen=True)  # frozen: the compiled chat template (_chat) never outlives its source
class Tokenizer:
    backend: tokenizers.Tokenizer
    eos_ids: frozenset[int]
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens applies the tokenizer's own post-processing (a BOS where the model wants one).
        encode_batch, unlike encode, releases the GIL: a long text tokenized in a thread leaves the others running."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text: a text of n bytes needs at least n / this many tokens."""
        texts = self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(len(text.encode()) for text in texts)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _chat(self) -> jinja2.Template:
        """The chat template, compiled once: compiling it for every request cost the gateway's event loop many
        times what rendering it does."""
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _refuse
        return env.from_string(self.chat_template)

    def __getstate__(self) -> dict:
        """Pickled without the compiled chat template (compiled again where it is first used)."""
        return {name: value for name, value in self.__dict__.items() if name != "_chat"}

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template applied to `messages`, ready for the assistant's reply."""
        if not self.chat_template:
            raise TreeserveError("this model has no chat template, which a chat request needs")
        try:
            return self._chat.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as error:
            raise TreeserveError(f"chat template could not be rendered: {error}") from None

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """A request's prompt ids: as one user turn through the chat template, or the text as it is."""
        return self.encode_chat(text) if chat else self.encode(text)

    def encode_chat(self, user_text: str) -> list[int]:
        return self.encode_messages([{"role": "user", "content": user_text}])

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation's ids through the chat template, ready for the assistant's reply."""
        # The template writes any BOS itself, so no special tokens are added on top.
        return self.encode(self.render_chat(messages), add_special_tokens=False)
