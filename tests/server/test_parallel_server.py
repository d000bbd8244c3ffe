"""The server on an engine split over 2 CPU processes: the streaming and disconnect tests of
one process pass unchanged."""

from __future__ import annotations

import pytest
from live_server import start_server
from test_api import (  # noqa: F401 - collected again here, against the 2-rank server
    client,
    test_chat_streamed_and_not,
    test_sixteen_concurrent_streams,
    test_streamed_equals_unstreamed,
)
from test_errors import (  # noqa: F401
    test_stream_disconnect_aborts_and_frees_blocks,
    test_unstreamed_disconnect_aborts,
)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with start_server(
        tiny_model_dir, max_num_seqs=32, max_waiting_requests=256, tensor_parallel_size=2
    ) as live:
        yield live
