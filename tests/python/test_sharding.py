import pytest

from tf_sok.python.sharding import ShardingSpec


@pytest.mark.parametrize("rows,n", [(10, 1), (10, 3), (7, 4), (2, 5)])
def test_distributed_local_rows_cover_table(rows, n):
    spec = ShardingSpec.parse("distributed")
    counts = [spec.local_rows(rows, r, n) for r in range(n)]
    assert sum(counts) == rows
    assert counts == [len(range(r, rows, n)) for r in range(n)]


def test_localized_owner_and_errors():
    spec = ShardingSpec.parse("localized:1")
    assert [spec.local_rows(9, r, 3) for r in range(3)] == [0, 9, 0]
    with pytest.raises(ValueError, match="needs rank 3"):
        ShardingSpec.parse("localized:3").validate(2, "t")
    with pytest.raises(ValueError, match="unknown table mode"):
        ShardingSpec.parse("rowwise")
