"""Decides when a request is finished: EOS, stop token ids, stop strings, length."""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.sampling_params import SamplingParams


@dataclass
class StopState:
    params: SamplingParams
    max_tokens: int  # resolved: never past the context length
    eos_token_ids: frozenset[int]
    stop_text_end: int | None = None  # where the text is cut when a stop string matched

    def check(self, output_token_ids: list[int], new_token_id: int, decode) -> str | None:
        """output_token_ids already holds new_token_id. decode(ids) -> text (only called when
        the request has stop strings). Returns "stop", "length" or None."""
        if not self.params.ignore_eos and new_token_id in self.eos_token_ids:
            return "stop"
        if new_token_id in self.params.stop_token_ids:
            return "stop"
        if self.params.stop:
            text = decode(output_token_ids)
            # Only the tail can hold a new match: the longest stop string plus one token's text.
            window = max(len(s) for s in self.params.stop) + 32
            search_from = max(0, len(text) - window)
            matches = [(index, s) for s in self.params.stop if (index := text.find(s, search_from)) >= 0]
            if matches:
                index, stop = min(matches)
                self.stop_text_end = index + (len(stop) if self.params.include_stop_str_in_output else 0)
                return "stop"
        if len(output_token_ids) >= self.max_tokens:
            return "length"
        return None

    def final_token_ids_for_text(self, output_token_ids: list[int], finish_reason: str) -> list[int]:
        """The tokens whose text is returned: a terminating EOS / stop id is not text."""
        if finish_reason == "stop" and output_token_ids and self.stop_text_end is None:
            last = output_token_ids[-1]
            if last in self.params.stop_token_ids or (not self.params.ignore_eos and last in self.eos_token_ids):
                return output_token_ids[:-1]
        return output_token_ids

    def final_text(self, text: str) -> str:
        return text if self.stop_text_end is None else text[: self.stop_text_end]
