#!/bin/bash
# Debian's Chromium, for the status page's test (tests/e2e/test_main_job.py drives it headless through
# Playwright's Python API, with this browser: Playwright's own browser download is never used). Needs root
# and apt; elsewhere it says why and exits 0, and that test checks the page's HTTP answers only.
set -euo pipefail
if command -v chromium > /dev/null || command -v chromium-browser > /dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "install_chromium.sh: Chromium not installed (needs root and apt-get); the status page's browser check will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq > /dev/null
apt-get install -y -qq --no-install-recommends chromium > /dev/null
echo "install_chromium.sh: $(chromium --version 2>/dev/null) installed"
