"""The Helm chart through Helm's real engine (helm-python-sdk, in a child process: it is a Go
shared library): it lints, renders for several value sets, every rendered manifest validates
against the Kubernetes OpenAPI schemas, the RBAC grants exactly `prorsa.kube.rbac`'s rules,
bad values fail at install with a readable message, and the chart's CRDs are the repo's."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from prorsa.kube import rbac

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "prorsa"
RELEASE, NAMESPACE = "prorsa", "ml"
# The oldest release the chart supports (Chart.yaml kubeVersion) and the newest schemas known.
KUBE_VERSIONS = ("1.29.0", "1.37.0")

_HELM = """
import json, sys
import helm_python as helm
cmd, chart, values = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
try:
    if cmd == "lint":
        out = helm.lint(chart, values, strict=True, namespace="ml")
    else:
        with helm.Chart.load(chart) as c:
            out = c.render(values, name="prorsa", namespace="ml", is_install=True)
    print(json.dumps({"ok": out}))
except helm.HelmError as e:
    print(json.dumps({"error": str(e)}))
"""


def helm(cmd: str, values: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _HELM, cmd, str(CHART)], input=json.dumps(values),
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


@functools.cache
def _render(values_json: str) -> tuple[dict[str, Any], ...]:
    out = helm("render", json.loads(values_json))
    assert "ok" in out, out.get("error")
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out["ok"].items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return tuple(docs)


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return list(_render(json.dumps(values or {}, sort_keys=True)))


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "cluster-wide": {"watch": {"clusterWide": True}},
    "several-namespaces": {"watch": {"namespaces": ["rl-a", "rl-b"]}},
    "bundled-redis": {"redis": {"enabled": True}},
    "bring-your-own-redis-secret": {"redis": {"enabled": True, "existingSecret": "my-redis"}},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True,
                                                       "labels": {"release": "kps"}}}},
    "custom-images": {"image": {"repository": "registry.example.com/ml/prorsa", "tag": "0.1.0-rc1",
                                "pullPolicy": "Always"},
                      "imagePullSecrets": [{"name": "regcred"}],
                      "operator": {"replicas": 3, "nodeSelector": {"pool": "cpu"}}},
    "no-extras": {"networkPolicy": {"enabled": False}, "dashboard": {"enabled": False},
                  "serviceAccount": {"create": False, "name": "existing"}},
}  # fmt: skip
NOT_BUILT_IN = {"KopfPeering", "ClusterKopfPeering", "ServiceMonitor"}  # custom resources


def test_the_chart_lints_clean_in_strict_mode() -> None:
    out = helm("lint", {})
    assert "ok" in out, out
    report = out["ok"]
    assert report["errors"] == [] or report["errors"] is None, report
    serious = [m for m in report.get("messages") or [] if m["severity"] >= 2]
    assert serious == [], serious


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_manifest_validates_against_kubernetes_schemas(name: str) -> None:
    docs = render(VALUE_SETS[name])
    assert of_kind(docs, "Deployment"), "the operator Deployment"
    checked = 0
    for doc in docs:
        if doc["kind"] in NOT_BUILT_IN:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {e}")
        checked += 1
    assert checked >= 5


def test_a_broken_manifest_fails_the_schema_check() -> None:
    """The validation above can fail: a misspelt field is caught in strict mode."""
    [dep] = of_kind(render(), "Deployment")
    broken = json.loads(json.dumps(dep))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[-1], strict=True)


def _rules(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"apiGroups": r["apiGroups"], "resources": r["resources"], "verbs": r["verbs"]}
            for r in doc["rules"]]  # fmt: skip


def test_namespaced_rbac_grants_exactly_the_declared_rules_and_no_cluster_role() -> None:
    docs = render(VALUE_SETS["several-namespaces"])
    assert of_kind(docs, "ClusterRole") == [] and of_kind(docs, "ClusterRoleBinding") == []
    roles = of_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["rl-a", "rl-b"]
    want = [r.as_dict() for r in rbac.operator_rules(clusterwide=False)]
    for role in roles:
        assert _rules(role) == want
    bindings = of_kind(docs, "RoleBinding")
    assert {b["subjects"][0]["namespace"] for b in bindings} == {NAMESPACE}
    peerings = of_kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["rl-a", "rl-b"]
    [dep] = of_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=rl-a" in args and "--namespace=rl-b" in args
    assert f"--peering={RELEASE}" in args


def test_cluster_wide_rbac_is_one_cluster_role_with_the_declared_rules() -> None:
    docs = render(VALUE_SETS["cluster-wide"])
    [role] = of_kind(docs, "ClusterRole")
    assert _rules(role) == [r.as_dict() for r in rbac.operator_rules(clusterwide=True)]
    assert of_kind(docs, "Role") == []
    assert len(of_kind(docs, "ClusterKopfPeering")) == 1
    [dep] = of_kind(docs, "Deployment")
    assert "--all-namespaces" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_router_role_the_operator_creates_is_within_what_the_operator_holds() -> None:
    """Kubernetes refuses to let the operator create a Role granting more than it holds."""
    for rule in rbac.ROUTER_RULES:
        for resource in rule.resources:
            for verb in rule.verbs:
                assert rbac.allowed(rbac.OPERATOR_RULES, rule.api_group, resource, verb)


def test_the_operator_runs_hardened() -> None:
    [dep] = of_kind(render(), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    [c] = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and "readinessProbe" in c
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert dep["spec"]["replicas"] == 2  # peering elects one
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["PRORSA_IMAGE"]["value"] == c["image"] == "ghcr.io/prorsa/prorsa:0.1.0"


def test_custom_images_reach_the_operator_and_its_routers() -> None:
    [dep] = of_kind(render(VALUE_SETS["custom-images"]), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["image"] == "registry.example.com/ml/prorsa:0.1.0-rc1"
    assert {e["name"]: e.get("value") for e in c["env"]}["PRORSA_IMAGE"] == c["image"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and dep["spec"]["replicas"] == 3


def test_bundled_redis_has_a_password_secret_and_is_off_by_default() -> None:
    assert not [d for d in render() if "redis" in d["metadata"]["name"]]
    docs = render(VALUE_SETS["bundled-redis"])
    [secret] = of_kind(docs, "Secret")
    assert len(secret["data"]["password"]) >= 32
    redis = next(d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("redis"))
    env = redis["spec"]["template"]["spec"]["containers"][0]["env"][0]
    assert env["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    own = render(VALUE_SETS["bring-your-own-redis-secret"])
    assert of_kind(own, "Secret") == []  # the user's Secret is used, none generated
    redis = next(d for d in of_kind(own, "Deployment") if d["metadata"]["name"].endswith("redis"))
    env = redis["spec"]["template"]["spec"]["containers"][0]["env"][0]
    assert env["valueFrom"]["secretKeyRef"]["name"] == "my-redis"


def test_only_routers_workers_and_the_operator_reach_worker_ports() -> None:
    [policy] = of_kind(render(), "NetworkPolicy")
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"]["podSelector"]["matchLabels"] == {"prorsa.io/component": "worker"}
    [ingress] = policy["spec"]["ingress"]
    sources = ingress["from"]
    assert {"podSelector": {"matchLabels": {"prorsa.io/component": "router"}}} in sources
    operator = [s for s in sources if "namespaceSelector" in s]
    assert operator[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert of_kind(render(VALUE_SETS["no-extras"]), "NetworkPolicy") == []


def test_service_monitors_scrape_the_operator_and_every_router() -> None:
    assert of_kind(render(), "ServiceMonitor") == []
    monitors = of_kind(render(VALUE_SETS["service-monitor"]), "ServiceMonitor")
    assert len(monitors) == 2
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["labels"]["release"] == "kps"
    routers = next(m for m in monitors if m["metadata"]["name"].endswith("routers"))
    assert routers["spec"]["selector"]["matchLabels"] == {"prorsa.io/component": "router"}
    assert routers["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def _exposed_metric_names() -> set[str]:
    """Every series name the controller and the router expose."""
    from prorsa.control.metrics import ControllerMetrics
    from prorsa.router.metrics import RouterMetrics
    from prorsa.router.pool import Pool

    names: set[str] = set()
    registries = [ControllerMetrics().registry, RouterMetrics(Pool(), lambda: None).registry]
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names |= {family.name + s for s in ("_bucket", "_count", "_sum")}
    return names


def test_every_dashboard_query_uses_metrics_the_code_exposes() -> None:
    [cm] = [
        d for d in of_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["prorsa.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bprorsa_[a-z_]+", e)}
    assert len(used) >= 10
    assert used <= _exposed_metric_names(), used - _exposed_metric_names()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("forecast", "switch", "ttft", "latency", "lag"):
        assert topic in titles


def test_helm_test_pod_checks_the_operator_health_endpoint() -> None:
    hooks = [d for d in of_kind(render(), "Pod")
             if (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]  # fmt: skip
    [pod] = hooks
    script = pod["spec"]["containers"][0]["command"][-1]
    assert f"{RELEASE}.{NAMESPACE}.svc:8080/healthz" in script


@pytest.mark.parametrize(("values", "fragment"), [
    ({"operator": {"replicas": 0}}, "replicas"),
    ({"operator": {"logFormat": "xml"}}, "logFormat"),
    ({"watch": {"clusterwide": True}}, "clusterwide"),
    ({"watch": {"namespaces": ["Not_A_Namespace"]}}, "namespaces"),
    ({"metrics": {"port": 8080}}, "port"),
    ({"image": {"repository": ""}}, "repository"),
])  # fmt: skip
def test_bad_values_fail_at_install_with_a_message_naming_the_value(
    values: dict[str, Any], fragment: str
) -> None:
    out = helm("render", values)
    assert "error" in out, f"{values} was accepted"
    assert "values don't meet the specifications of the schema" in out["error"]
    assert fragment in out["error"], out["error"]


def test_the_charts_crds_are_the_repos() -> None:
    repo = {p.name: p.read_text() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    assert chart == repo
    assert "rolloutclusters.prorsa.io.yaml" in chart


def test_chart_and_package_versions_agree() -> None:
    import tomllib

    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["apiVersion"] == "v2" and meta["appVersion"] == project["version"]
    from prorsa.api.models import DEFAULT_OPERATOR_IMAGE, DEFAULT_WORKER_IMAGE

    assert DEFAULT_OPERATOR_IMAGE.endswith(":" + project["version"])
    assert DEFAULT_WORKER_IMAGE.endswith(":" + project["version"])
