"""Builds a pure-Python wheel of mamba_ssm from its source distribution, without the CUDA
extensions (the GPU machine cannot build them, and PyPI has no binary wheel): the package's
Python files, Triton kernels included, and a dist-info naming what was left out.

    python3 runners/mamba_wheel.py SDIST.tar.gz OUT_DIR

`runners/fetch_wheels.sh` downloads the source distribution and calls this; the wheel travels
in .carry/whl/ like the others. Importing `mamba_ssm` itself still fails without the
extension (`selective_scan_cuda`); `runners/compare/mamba_mixers.py` loads the Triton SSD
modules directly.
"""

import base64
import hashlib
import io
import os
import sys
import tarfile
import zipfile


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (name, digest, len(data))


def build(sdist, out_dir):
    """Writes the wheel into out_dir; returns its path."""
    files = {}
    version = None
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) != 2 or not member.isfile():
                continue
            inner = parts[1]
            if inner == "PKG-INFO":
                for line in tar.extractfile(member).read().decode().splitlines():
                    if line.startswith("Version: "):
                        version = line.split(": ", 1)[1].strip()
            if inner.startswith("mamba_ssm/") and inner.endswith(".py"):
                files[inner] = tar.extractfile(member).read()
    if version is None or "mamba_ssm/__init__.py" not in files:
        raise SystemExit("%s: not a mamba_ssm source distribution" % sdist)
    dist_info = "mamba_ssm-%s.dist-info" % version
    metadata = ("Metadata-Version: 2.1\nName: mamba_ssm\nVersion: %s\n"
                "Summary: mamba_ssm's Python sources and Triton kernels, without its CUDA "
                "extensions (selective_scan_cuda), built by kernelpages' runners/mamba_wheel.py "
                "from the source distribution\n" % version).encode()
    wheel = b"Wheel-Version: 1.0\nGenerator: kernelpages mamba_wheel.py\nRoot-Is-Purelib: true\n" \
            b"Tag: py3-none-any\n"
    files[dist_info + "/METADATA"] = metadata
    files[dist_info + "/WHEEL"] = wheel
    record = [record_line(n, d) for n, d in sorted(files.items())]
    record.append(dist_info + "/RECORD,,")
    files[dist_info + "/RECORD"] = ("\n".join(record) + "\n").encode()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "mamba_ssm-%s-py3-none-any.whl" % version)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(files):
            z.writestr(name, files[name])
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: mamba_wheel.py SDIST.tar.gz OUT_DIR")
    print(build(sys.argv[1], sys.argv[2]))
