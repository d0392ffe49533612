import pytest

from drivetrain.api.version import VersionRange, parse_version


@pytest.mark.parametrize(
    ("spec", "version", "inside"),
    [
        (">=0.1,<0.2", "0.1.0", True),
        (">=0.1,<0.2", "0.1.9", True),
        (">=0.1,<0.2", "0.2", False),
        ("==0.1", "0.1.0", True),
        ("!=0.1.1", "0.1.1", False),
        ("~=0.1", "0.9", True),
        ("~=0.1", "1.0", False),
        ("~=0.1.2", "0.1.5", True),
        ("~=0.1.2", "0.2.0", False),
        (">0.1", "0.1.0", False),
        ("<=1", "1.0.0", True),
    ],
)
def test_version_ranges(spec, version, inside):
    assert VersionRange.parse(spec).contains(version) is inside


def test_bad_versions_and_ranges():
    with pytest.raises(ValueError, match="not a release version"):
        parse_version("0.1rc1")
    with pytest.raises(ValueError, match="must start with"):
        VersionRange.parse("0.1")
