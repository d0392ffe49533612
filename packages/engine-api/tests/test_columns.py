"""The column contract is data: every column the api names has a dtype a test can check."""

from drivetrain.api import columns


def test_every_named_column_has_a_dtype():
    named = {
        value
        for name, value in vars(columns).items()
        if name.isupper() and isinstance(value, str) and name != "DTYPES"
    }
    assert set(columns.DTYPES) == named
    assert named >= columns.TOKEN_COLUMNS
    assert set(columns.DTYPES.values()) == {"int64", "float32", "int16"}
    assert columns.DTYPES[columns.ROUTED_EXPERTS] == "int16"  # 2 bytes per layer and pick
    assert columns.DTYPES[columns.LOSS_MASK] == "float32"  # losses multiply by it
