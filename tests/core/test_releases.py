"""The TensorFlow releases the project supports, decided without TensorFlow (the TPU launcher
asks on a workstation where it need not be installed)."""

import pytest

from framework.core import releases


@pytest.mark.parametrize("version", ["2.20.0", "2.21.1", "2.21.0rc1", "2.20.0-dev20260101"])
def test_any_patch_of_a_supported_release_is_supported(version):
    assert releases.is_supported_tensorflow(version)


@pytest.mark.parametrize("version", ["2.19.1", "2.22.0", "2.200.0", "3.0.0", "nightly", "-"])
def test_other_releases_and_non_versions_are_not(version):
    assert not releases.is_supported_tensorflow(version)
