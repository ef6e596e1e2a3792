"""What a GPU call checks of its carried site before any GPU time goes to a part (bench/gpu_site.py): pinned wheels
all there, every requirement of every carried wheel met, by a wheel carried or by the version that imports."""

from __future__ import annotations

import zipfile
from pathlib import Path

from bench import gpu_site


def wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", meta)


def installed(folder: Path, name: str, version: str, *requires: str) -> None:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires))


def test_a_carried_wheel_needing_what_the_image_may_lack_fails_the_carry(tmp_path):
    """pydantic needs typing-extensions>=4.16: the image has some typing-extensions of unknown age, so it must
    be carried; a pinned wheel that did not download is named too."""
    wheel(tmp_path, "pydantic", "2.14.4", "typing-extensions>=4.16.0", "annotated-types>=0.6.0")
    wheel(tmp_path, "annotated-types", "0.8.0")
    wheel(tmp_path, "gguf", "0.19.0", "numpy (>=1.17)", "pyyaml (>=5.1)", 'sphinx; extra == "docs"')
    problems = gpu_site.check_carry(tmp_path, ["pydantic==2.14.4", "annotated-types==0.8.0", "msgspec==0.22.0"])
    assert problems == ["msgspec==0.22.0: no wheel of it in " + str(tmp_path),
                        "pydantic 2.14.4 needs typing-extensions>=4.16.0: neither carried nor known in the GPU image"]
    wheel(tmp_path, "typing-extensions", "4.16.0")
    wheel(tmp_path, "msgspec", "0.22.0")
    assert gpu_site.check_carry(tmp_path, ["pydantic==2.14.4", "msgspec==0.22.0"]) == []
    # A floor newer than the image's known version must be carried as well.
    wheel(tmp_path, "needs-new-numpy", "1.0", "numpy>=3")
    assert gpu_site.check_carry(tmp_path, []) == ["needs-new-numpy 1.0 needs numpy>=3: 2.5.2 is there"]


def test_on_the_machine_a_requirement_is_met_by_the_version_that_imports(tmp_path):
    site, image = tmp_path / "site", tmp_path / "image"
    installed(site, "pydantic", "2.14.4", "typing-extensions>=4.16.0")
    installed(image, "typing-extensions", "4.12.2")
    assert gpu_site.check_site(site, [str(site), str(image)]) == [
        "pydantic 2.14.4 needs typing-extensions>=4.16.0: 4.12.2 is there"]
    installed(site, "typing-extensions", "4.16.0")  # carried: the site is first on the path
    assert gpu_site.check_site(site, [str(site), str(image)]) == []
