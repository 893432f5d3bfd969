"""What deploy/ ships: every Kubernetes manifest validates offline against
the Kubernetes schemas (kubernetes-validate bundles them), and the manifests,
Dockerfiles and build script keep the promises docs/operations/ makes."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from typing import Any, Dict, List

import yaml
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from rolemesh.config.file import NodeConfig, deep_merge, validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBE = os.path.join(REPO, "deploy", "kubernetes")
DOCKER = os.path.join(REPO, "deploy", "docker")
BUILD_STEPS = os.path.join(REPO, "scripts", "container-build-steps.sh")
#: The Kubernetes version the manifests are checked against.
KUBERNETES_VERSION = "1.30.0"


def manifests() -> List[str]:
    return sorted(glob.glob(os.path.join(KUBE, "*.yaml")))


def documents() -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    for path in manifests():
        with open(path, encoding="utf-8") as f:
            out.extend(d for d in yaml.safe_load_all(f) if d)
    return out


def of_kind(kind: str) -> List[Dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def agent(daemonset: Dict[str, Any]) -> Dict[str, Any]:
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "agent")


class KubernetesValidateTests(SynchronousTestCase):
    def test_every_manifest_validates_strictly(self) -> None:
        try:
            import kubernetes_validate
        except ImportError:
            raise SkipTest("kubernetes-validate is not installed (pip install -e '.[test]')") from None
        self.assertTrue(manifests())
        for path in manifests():
            with open(path, encoding="utf-8") as f:
                for document in yaml.safe_load_all(f):
                    if not document:
                        continue
                    try:
                        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
                    except kubernetes_validate.ValidationError as e:
                        self.fail(f"{os.path.basename(path)}: {e.message} at {list(e.path)}")

    def test_a_broken_manifest_is_caught(self) -> None:
        """The check above can fail: a misspelt probe field does not validate."""
        try:
            import kubernetes_validate
        except ImportError:
            raise SkipTest("kubernetes-validate is not installed (pip install -e '.[test]')") from None

        daemonset = of_kind("DaemonSet")[0]
        broken = yaml.safe_load(yaml.safe_dump(daemonset))
        probe = agent(broken)["readinessProbe"]
        probe["periodSecond"] = probe.pop("periodSeconds")
        with self.assertRaises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


class ManifestPromiseTests(SynchronousTestCase):
    def test_a_daemonset_per_gpu_vendor_and_one_for_cpu(self) -> None:
        selectors = {}
        for ds in of_kind("DaemonSet"):
            spec = ds["spec"]["template"]["spec"]
            selectors[ds["metadata"]["name"]] = spec.get("nodeSelector", {})
        self.assertEqual(selectors["rolemesh-node-nvidia"], {"feature.node.kubernetes.io/pci-10de.present": "true"})
        self.assertEqual(selectors["rolemesh-node-amd"], {"feature.node.kubernetes.io/pci-1002.present": "true"})
        self.assertIn("rolemesh-node-cpu", selectors)
        nvidia = next(d for d in of_kind("DaemonSet") if d["metadata"]["name"] == "rolemesh-node-nvidia")
        self.assertEqual(nvidia["spec"]["template"]["spec"]["runtimeClassName"], "nvidia")
        self.assertIn("nvidia.com/gpu", agent(nvidia)["resources"]["limits"])

    def test_probes_and_the_drain(self) -> None:
        defaults = NodeConfig(node_id="x")
        for ds in of_kind("DaemonSet"):
            container = agent(ds)
            self.assertEqual(container["startupProbe"]["httpGet"]["path"], "/ready")
            self.assertEqual(container["readinessProbe"]["httpGet"]["path"], "/ready")
            self.assertEqual(container["livenessProbe"]["httpGet"]["path"], "/health")
            self.assertIn("preStop", container["lifecycle"])
            pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
            grace = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            drain = defaults.shutdown_grace_s + defaults.llama_server_stop_timeout_s + float(pre_stop[-1])
            self.assertGreater(grace, drain, ds["metadata"]["name"])
            annotations = ds["spec"]["template"]["metadata"]["annotations"]
            self.assertEqual(annotations["prometheus.io/scrape"], "true")
            self.assertEqual(annotations["prometheus.io/path"], "/metrics")
            security = container["securityContext"]
            self.assertFalse(security["allowPrivilegeEscalation"])
            self.assertTrue(ds["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"])

    def test_config_is_mounted_as_a_folder_so_reload_sees_changes(self) -> None:
        for ds in of_kind("DaemonSet"):
            container = agent(ds)
            args = container["args"]
            config = args[args.index("--config") + 1]
            override = args[args.index("--config-override") + 1]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            self.assertIn(os.path.dirname(config), mounts)
            self.assertIn(os.path.dirname(override), mounts)
            for mount in mounts.values():
                self.assertNotIn("subPath", mount)  # a subPath mount never sees ConfigMap updates

    def test_configmap_and_secret_make_a_valid_config(self) -> None:
        (configmap,) = of_kind("ConfigMap")
        (secret,) = of_kind("Secret")
        base = yaml.safe_load(configmap["data"]["node.yaml"])
        override = yaml.safe_load(secret["stringData"]["secrets.yaml"])
        self.assertNotIn("api_keys", base)
        self.assertNotIn("dispatcher_token", base)
        config = validate(deep_merge(base, override), check_files=False, environ={})
        self.assertEqual(config.listen_port, 8090)
        self.assertTrue(config.api_keys)
        self.assertTrue(config.dispatcher_token)
        for ds in of_kind("DaemonSet"):
            ports = [p["containerPort"] for p in agent(ds)["ports"]]
            self.assertEqual(ports, [config.listen_port])
            annotations = ds["spec"]["template"]["metadata"]["annotations"]
            self.assertEqual(annotations["prometheus.io/port"], str(config.listen_port))


class DockerfileTests(SynchronousTestCase):
    def read(self, name: str) -> str:
        with open(os.path.join(DOCKER, name), encoding="utf-8") as f:
            return f.read()

    def test_conventions(self) -> None:
        for name in ("Dockerfile", "Dockerfile.cuda"):
            text = self.read(name)
            self.assertIn("RUN scripts/container-build-steps.sh /opt/rolemesh/venv", text, name)
            self.assertRegex(text, r"(?m)^USER 10001", name)
            self.assertRegex(text, r"(?m)^EXPOSE 8090$", name)
            self.assertRegex(text, r"(?m)^HEALTHCHECK .*\n.*127\.0\.0\.1:8090/health", name)
            self.assertIn('CMD ["--config", "/etc/rolemesh/config/node.yaml"]', text, name)
            self.assertTrue(os.path.exists(os.path.join(DOCKER, name + ".dockerignore")), name)
        self.assertIn("-DGGML_CUDA=ON", self.read("Dockerfile.cuda"))

    def test_build_steps_install_llama_server_through_the_project_script(self) -> None:
        with open(BUILD_STEPS, encoding="utf-8") as f:
            text = f.read()
        self.assertIn('"$root/scripts/install-llama-server.sh" "$venv/bin/python"', text)
        self.assertTrue(os.access(BUILD_STEPS, os.X_OK))
        result = subprocess.run(["bash", "-n", BUILD_STEPS], capture_output=True, text=True, timeout=30)
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_shellcheck(self) -> None:
        shellcheck = shutil.which("shellcheck")
        if shellcheck is None:
            raise SkipTest("shellcheck is not installed")
        result = subprocess.run([shellcheck, BUILD_STEPS], capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stdout)

    def test_the_unit_and_images_agree_on_the_state_folder(self) -> None:
        unit = open(os.path.join(REPO, "deploy", "systemd", "rolemesh-node.service"), encoding="utf-8").read()
        self.assertIn("Environment=XDG_STATE_HOME=/var/lib", unit)
        self.assertIn("StateDirectory=rolemesh-node", unit)
        for name in ("Dockerfile", "Dockerfile.cuda"):
            self.assertTrue(re.search(r"XDG_STATE_HOME=/var/lib", self.read(name)), name)
