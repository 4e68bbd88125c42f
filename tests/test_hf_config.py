"""A Hugging Face config.json that cannot be read is one error naming the file and why
(read_hf_config in megatron/training/checkpoint_hf.py), not a JSONDecodeError traceback."""

import pytest

from megatron.training.checkpoint_hf import ConversionError, read_hf_config


@pytest.mark.parametrize("content,fragment", [
    (b"\xff\xfe\x00binary", "byte 0 is not UTF-8"),
    (b'{"model_type": "llama",', "not a JSON config (line 1"),
    (b"[1, 2]", "expected a JSON object"),
])
def test_a_config_json_that_is_not_a_json_object_is_one_error_naming_it(content, fragment,
                                                                        tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ConversionError) as exc:
        read_hf_config(str(path))
    assert str(path) in str(exc.value) and fragment in str(exc.value)
    assert len(str(exc.value).splitlines()) == 1


def test_a_config_json_object_is_returned_as_is(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64}')
    assert read_hf_config(str(path)) == {"model_type": "llama", "hidden_size": 64}
