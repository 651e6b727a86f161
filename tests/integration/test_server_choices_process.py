"""test_server_choices.py's tests (logprobs, echo, lists of prompts, n > 1 with seeds, streamed choices, a disconnect
that aborts every choice) against `engram serve --engine-loop process`, whose API process detokenizes and frames the
choices' chunks from the engine process's token ids: imported, so the assertions are the same ones."""
from __future__ import annotations

import openai
import pytest

from engram.server.launcher import ServerProcess
from tests.integration.test_server_choices import (  # noqa: F401  (collected here, against this module's server)
    MAX_NUM_SEQS, MAX_WAITING, test_chat_logprobs_and_n, test_completion_logprobs_shape_and_greedy_consistency,
    test_disconnect_aborts_every_choice, test_echo_max_tokens_0_scores_the_prompt_alike_for_text_and_token_ids,
    test_list_of_prompts_times_n_numbers_choices_prompt_major,
    test_n_with_seed_is_reproducible_and_choice_j_uses_seed_plus_j, test_streamed_choices_reassemble_to_the_body)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    with ServerProcess(["tiny", "--threads", "1", "--dtype", "float64", "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-waiting", str(MAX_WAITING), "--engine-loop", "process"], cache,
                       tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
