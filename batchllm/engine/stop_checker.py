"""Decides when a request is finished: EOS, stop token ids, stop strings (checked incrementally:
docs/design.md, "The step loop"), length; and the returned text, as vLLM's detokenizer gives it."""

from __future__ import annotations

from collections.abc import Callable

from batchllm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a decode shows for the bytes of an unfinished character


class IncrementalText:
    """The text of a growing token list, decoding only its newest tokens."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.stable_text = ""  # the text of token_ids[:read_offset]: complete characters only
        self.prefix_offset = 0  # the lookback decoded with the new tokens
        self.read_offset = 0

    def text(self, token_ids: list[int]) -> tuple[str, int]:
        """(the text of all of token_ids, how many leading characters of it are final)."""
        prefix_text = self.decode(token_ids[self.prefix_offset:self.read_offset])
        window_text = self.decode(token_ids[self.prefix_offset:])
        if window_text.startswith(prefix_text):
            text = self.stable_text + window_text[len(prefix_text):]
        else:  # the lookback decodes differently on its own (rare): decode the whole output
            text = self.decode(token_ids)
        if text.endswith(REPLACEMENT_CHAR):
            return text, len(self.stable_text)  # wait for the character's last bytes
        self.stable_text = text
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return text, len(text)


class StopChecker:
    def __init__(self, params: SamplingParams, max_tokens: int, eos_token_ids: frozenset[int],
                 decode: Callable[[list[int]], str]) -> None:
        self.params = params
        self.max_tokens = max_tokens  # resolved: never past the context length
        self.eos_token_ids = eos_token_ids
        self.decode = decode  # the request's decode (skip_special_tokens as its params ask)
        self.stop_text: str | None = None  # the returned text when a stop string matched
        self.stop_string: str | None = None  # the stop string that matched
        self._text = IncrementalText(decode) if params.stop else None
        self._num_searched_chars = 0  # final characters already searched without a match

    def check(self, output_token_ids: list[int]) -> str | None:
        """output_token_ids ends with the new token. Returns "stop", "length" or None. As in vLLM,
        no stop token ends a request before min_tokens tokens, and a stop string only matches
        text that ends after them."""
        num_tokens, min_tokens = len(output_token_ids), self.params.min_tokens
        if num_tokens >= min_tokens and self._is_stop_token(output_token_ids[-1]):
            return "stop"
        if self._text is not None:
            if num_tokens > min_tokens:
                if self._find_stop_string(output_token_ids):
                    return "stop"
            else:  # searched past: a later match must end after this text
                self._num_searched_chars = self._text.text(output_token_ids)[1]
        if len(output_token_ids) >= self.max_tokens:
            return "length"
        return None

    def _is_stop_token(self, token_id: int) -> bool:
        params = self.params
        return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)

    def _find_stop_string(self, output_token_ids: list[int]) -> bool:
        """The first stop string, in the order of params.stop, that the new characters complete
        (vLLM's rule: list order, not the earliest place in the text)."""
        text, num_final_chars = self._text.text(output_token_ids)
        searched = self._num_searched_chars
        self._num_searched_chars = num_final_chars
        match = next(((index, s) for s in self.params.stop
                      if (index := text.find(s, max(0, searched - len(s) + 1))) >= 0), None)
        if match is None:
            return False
        index, stop = match
        end = index + (len(stop) if self.params.include_stop_str_in_output else 0)
        self.stop_text, self.stop_string = text[:end], stop
        return True

    def stop_reason(self, output_token_ids: list[int], finish_reason: str | None) -> str | int | None:
        """vLLM's stop_reason: the stop string or the stop_token_ids id that ended the request;
        None for EOS (checked first, as vLLM does), length and errors."""
        if finish_reason != "stop":
            return None
        if self.stop_string is not None:
            return self.stop_string
        last = output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return None
        return last if last in self.params.stop_token_ids else None

    def final_text(self, output_token_ids: list[int], finish_reason: str) -> str:
        """The returned text, as vLLM's detokenizer gives it: cut before a matched stop string
        (after it with include_stop_str_in_output); a terminating EOS or stop_token_ids token is
        left out of the text unless include_stop_str_in_output (it stays in the token ids, the
        completion_tokens and the logprobs, as in vLLM)."""
        if self.stop_text is not None:
            return self.stop_text
        if (finish_reason == "stop" and output_token_ids and not self.params.include_stop_str_in_output
                and self._is_stop_token(output_token_ids[-1])):
            return self.decode(output_token_ids[:-1])
        return self.decode(output_token_ids)
