"""Incremental detokenization for streaming: token ids in, text that can no longer change out."""

from __future__ import annotations

from treeserve.tokenizer import Tokenizer


class TextStream:
    """Token ids in, newly settled text out: the rules of Generation.text(), applied incrementally.

    Never emits part of a character (a decode ending in U+FFFD waits for the next tokens), the text of a stop
    token, or anything from a stop string on; while running, the last len(longest stop string) - 1 characters
    wait until they can no longer begin one. Decoding covers only the tokens since the last settled point, so a
    step costs the same at token 10 as at token 10,000.
    """

    def __init__(self, tokenizer: Tokenizer, stop_ids=(), stop_strings=()):
        self.tokenizer, self.stop_ids, self.stop_strings = tokenizer, frozenset(stop_ids), tuple(stop_strings)
        self.hold = max(map(len, self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.start = self.mid = 0  # ids[start:mid] are already in self.text: context for decoding what follows
        self.text = ""
        self.sent = 0  # characters of self.text already returned
        self.stopped = False  # a stop token or a stop string ended the text

    def push(self, token_ids, final: bool = False) -> str:
        """Adds one step's tokens; final: the generation is over, so everything left is settled."""
        for token in token_ids:
            if self.stopped:
                break
            if token in self.stop_ids:
                self.stopped = True
            else:
                self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.start:self.mid])
        after = self.tokenizer.decode(self.ids[self.start:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.start, self.mid = self.mid, len(self.ids)
            # A match that starts before `sent` would have been complete, and found, one step earlier.
            found = [i for s in self.stop_strings if (i := self.text.find(s, self.sent)) >= 0]
            if found:
                self.text, self.stopped = self.text[:min(found)], True
                self.start = self.mid = len(self.ids)  # nothing is decoded after a stop string
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        text, self.sent = self.text[self.sent:end], end
        return text
