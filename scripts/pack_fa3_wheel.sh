#!/usr/bin/env bash
# Fetch FlashAttention-3 (the tokenspeed-fa3 build the device's torch runs) and pack it for a device
# call: the 63 MB wheel, unpacked and recompressed with xz, is 24 MB in .whl/ (gitignored; carry
# [".whl"]: the tree plus carried files must stay under 64 MiB). scripts/verify_gpu.sh and
# scripts/device_run.py unpack .whl/*.tar.xz into /tmp/site on the device.
#
#   bash scripts/pack_fa3_wheel.sh            # writes .whl/tokenspeed_fa3.tar.xz
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work" tokenspeed-fa3
mkdir -p "$work/unpacked" .whl
(cd "$work/unpacked" && python3 -m zipfile -e "$work"/tokenspeed_fa3-*.whl .)
XZ_OPT="-9 -T0" tar -cJf .whl/tokenspeed_fa3.tar.xz -C "$work/unpacked" .
rm -rf "$work"
ls -la .whl/tokenspeed_fa3.tar.xz
