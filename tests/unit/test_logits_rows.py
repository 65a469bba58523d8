"""The LM head's padded row counts: few distinct shapes, little padding."""

from services.worker.engine.runner import logits_rows


def test_row_counts():
    assert [logits_rows(m) for m in (0, 1, 3, 4, 5, 8, 9, 33, 64, 65, 1000, 1024)] == \
        [0, 1, 3, 4, 8, 8, 16, 64, 64, 128, 1024, 1024]
    counts = {logits_rows(m) for m in range(1, 1025)}
    assert len(counts) <= 4 + 4 + 16  # exact, powers of two to 64, multiples of 64
    assert all(0 <= logits_rows(m) - m < 64 for m in range(1, 4097))
