"""Hostile inputs, class "files outside the model folder": a path taken from a model's
metadata (the shard index's file names) stays inside the model's folder. Nothing
outside it is opened, and no error echoes what such a file holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from hostile_files import write_hf_folder
from hostile_runner import case, check, run_cases
from polyengine.errors import WeightsError

SECRET = "root:x:0:0:TOP-SECRET-CONTENT"


def _secret_file(tmp: Path) -> Path:
    """A file outside the model folder that must never be read (a stand-in for /etc/passwd)."""
    outside = tmp / "secret.safetensors"
    outside.write_text(SECRET * 100)
    return outside


def _sharded(tmp: Path, shard_name: str) -> Path:
    from polyengine.models.presets import preset_config

    names = list(preset_config("tiny").weight_shapes())
    folder = write_hf_folder(tmp / "m", shards={"a.safetensors": names[:3], "b.safetensors": names[3:]})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][names[0]] = shard_name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _load_expecting_no_secret(folder: Path) -> None:
    from polyengine.models import load_model

    try:
        load_model(str(folder))
    except WeightsError as exc:
        assert "TOP-SECRET" not in str(exc) and "root:x" not in str(exc), f"the error echoes the file: {exc}"
        raise


@case(WeightsError, "model.safetensors.index.json", "outside", "../secret.safetensors")
def shard_index_climbs_out_of_the_folder(tmp):
    _secret_file(tmp)
    _load_expecting_no_secret(_sharded(tmp, "../secret.safetensors"))


@case(WeightsError, "model.safetensors.index.json", "outside")
def shard_index_names_an_absolute_path(tmp):
    _load_expecting_no_secret(_sharded(tmp, str(_secret_file(tmp))))


@case(WeightsError, "model.safetensors.index.json", "outside", "/etc/passwd")
def shard_index_names_etc_passwd(tmp):
    _load_expecting_no_secret(_sharded(tmp, "/etc/passwd"))


@case(WeightsError, "model.safetensors.index.json", "outside")
def shard_index_climbs_out_through_a_subfolder(tmp):
    _secret_file(tmp)
    folder = _sharded(tmp, "sub/../../secret.safetensors")
    (folder / "sub").mkdir()
    _load_expecting_no_secret(folder)


@case(WeightsError, "model.safetensors.index.json", "file name")
def shard_index_names_the_folder_itself(tmp):
    _load_expecting_no_secret(_sharded(tmp, "."))


@case(WeightsError, "model.safetensors.index.json", "file name")
def shard_index_name_with_a_nul_byte(tmp):
    _load_expecting_no_secret(_sharded(tmp, "a.safetensors\x00.txt"))


@case(WeightsError, "model.safetensors.index.json", "string")
def shard_index_name_is_a_number(tmp):
    folder = _sharded(tmp, "a.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = 7
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _load_expecting_no_secret(folder)


@case(WeightsError, "weight_map")
def shard_index_weight_map_is_a_list(tmp):
    folder = _sharded(tmp, "a.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a.safetensors"]}))
    _load_expecting_no_secret(folder)


@case(WeightsError, "model.safetensors")
def a_weights_file_that_is_not_safetensors_is_not_echoed(tmp):
    folder = write_hf_folder(tmp / "m")
    (folder / "model.safetensors").write_text(SECRET * 100)
    _load_expecting_no_secret(folder)


@case(None)
def shards_inside_the_folder_still_load(tmp):
    from polyengine.models import load_model
    from polyengine.models.presets import preset_config

    names = list(preset_config("tiny").weight_shapes())
    folder = write_hf_folder(tmp / "m", shards={"sub/a.safetensors": [], "a.safetensors": names[:3],
                                                "b.safetensors": names[3:]})
    assert load_model(str(folder)).config.num_hidden_layers == 2


@case(None)
def the_folders_own_symlinks_are_followed(tmp):
    """The Hugging Face cache links each file of a snapshot to a blob outside it: the
    folder's own links are the folder owner's, and load."""
    from polyengine.models import load_model

    folder = write_hf_folder(tmp / "snapshot")
    blobs = tmp / "blobs"
    blobs.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (folder / name).rename(blobs / name)
        (folder / name).symlink_to(blobs / name)
    assert load_model(str(folder)).config.num_hidden_layers == 2


def test_paths_from_metadata_stay_inside_the_model_folder(tmp_path):
    results = run_cases(__name__.rpartition(".")[2], tmp_path)
    problems = check(__name__.rpartition(".")[2], results)
    assert not problems, "\n".join(problems)
