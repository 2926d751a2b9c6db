"""Chained block hashes: known answers, prefix dependence, salt separation."""

import pytest

from pdserve.engine.hashing import ROOT_PARENT, engine_salt, hash_block, hash_blocks, request_salt


def test_known_answers():
    # Pinned values: a change here changes every hash in every running index.
    salt = engine_salt("abc", 16, "float32")
    assert salt.hex() == "fd01100642c1392e63ed596ae4987425"
    assert hash_block(ROOT_PARENT, [1, 2, 3, 4], salt).hex() == "aab4016c90dbcd954793d9428e1d3780"
    assert [h.hex() for h in hash_blocks([1, 7, 7, 3, 9, 4, 2, 8], 4, b"k" * 16)] == [
        "15df246c5db7af9df12582f4ee1f95fc", "abdf66c2fb22d7732dacd20e67a11023"]


def test_only_full_blocks_are_hashed():
    salt = engine_salt("m", 4, "float32")
    assert len(hash_blocks(list(range(7)), 4, salt)) == 1
    assert len(hash_blocks(list(range(8)), 4, salt)) == 2
    assert hash_blocks([1, 2, 3], 4, salt) == []


def test_edit_invalidates_its_block_and_everything_after():
    salt = engine_salt("m", 4, "float32")
    base = hash_blocks(list(range(16)), 4, salt)
    edited_ids = list(range(16))
    edited_ids[5] = 99  # block 1
    edited = hash_blocks(edited_ids, 4, salt)
    assert edited[0] == base[0]
    assert all(a != b for a, b in zip(edited[1:], base[1:]))


def test_same_tokens_under_another_prefix_hash_differently():
    salt = engine_salt("m", 2, "float32")
    a = hash_blocks([1, 2, 3, 4], 2, salt)
    b = hash_blocks([9, 9, 3, 4], 2, salt)
    assert a[1] != b[1]  # block [3, 4] is tied to its whole prefix


def test_salt_separates_models_block_sizes_and_dtypes():
    ids = list(range(32))
    salts = [engine_salt("m1", 16, "float32"), engine_salt("m2", 16, "float32"),
             engine_salt("m1", 16, "float16"), engine_salt("m1", 16, "int8"), engine_salt("m1", 16, "fp8")]
    first_hashes = {hash_blocks(ids, 16, s)[0] for s in salts}
    assert len(first_hashes) == 5
    assert engine_salt("m1", 8, "float32") != engine_salt("m1", 16, "float32")


def test_a_request_cache_salt_keys_its_hashes_apart():
    salt = engine_salt("m", 4, "float32")
    assert request_salt(salt, b"") == salt
    a, b = request_salt(salt, b"tenant-a"), request_salt(salt, b"tenant-b")
    assert len({salt, a, b}) == 3 and len(a) == len(salt)
    tokens = list(range(8))
    assert hash_blocks(tokens, 4, a) != hash_blocks(tokens, 4, b) != hash_blocks(tokens, 4, salt)
    assert request_salt(engine_salt("m2", 4, "float32"), b"tenant-a") != a  # the engine's salt still counts


def test_the_salt_names_the_row_format_so_int8_rows_of_its_first_encoding_never_match():
    """int8's rows changed encoding (pdserve/engine/kv_format.py); the other dtypes' salts did not."""
    import hashlib

    def first_salt(kv_dtype: str) -> bytes:  # engine_salt before row formats
        return hashlib.sha256(f"pdserve-kv-v1|m1|bs=16|dtype={kv_dtype}".encode()).digest()[:16]

    for kv_dtype in ("float32", "float16", "bfloat16", "fp8"):
        assert engine_salt("m1", 16, kv_dtype) == first_salt(kv_dtype)
    assert engine_salt("m1", 16, "int8") != first_salt("int8")


def test_prompt_hashes_read_as_hash_blocks_does():
    from pdserve.engine.hashing import PromptHashes
    salt = b"s" * 16
    tokens = list(range(1000, 1000 + 16 * 20 + 5))  # 20 full blocks and a partial one
    whole = hash_blocks(tokens, 16, salt)
    lazy = PromptHashes(tokens, 16, salt)
    assert len(lazy) == 20
    assert lazy[13] == whole[13] and lazy[-1] == whole[-1] and lazy[0] == whole[0]
    assert lazy[3:9] == whole[3:9] and lazy[::-3] == whole[::-3] and lazy[30:] == []
    assert list(lazy) == whole
    chained = hash_blocks(tokens, 16, salt, parent=whole[0])
    assert list(PromptHashes(tokens, 16, salt, parent=whole[0])) == chained
    with pytest.raises(IndexError):
        lazy[20]


def test_prompt_hashes_hash_a_block_only_when_it_or_a_later_one_is_read():
    """The router's decision hashes what its index match reads: a cold prompt costs one chunk."""
    from pdserve.engine.hashing import PromptHashes
    lazy = PromptHashes(list(range(16 * 64)), 16, b"s" * 16)
    assert lazy.computed == 0
    lazy[0]
    assert lazy.computed == PromptHashes.CHUNK_BLOCKS
    lazy[40]
    assert lazy.computed == 41
