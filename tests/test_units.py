from pdserve.units import human_bytes


def test_human_bytes_picks_the_largest_unit_that_fits():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**20, decimals=2) == "3.00 MiB"
    assert human_bytes(1500 * 2**30) == "1,500.0 GiB"
