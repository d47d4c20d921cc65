import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    # The rollout tests run tiny models step by step; on the 2-core CPU machine, two intra-op
    # threads make each small matmul several times slower than one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
