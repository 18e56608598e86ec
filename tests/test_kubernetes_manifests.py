"""deployments/kubernetes/ checked offline: the manifests and the Prefect work-pool template validate,
and a broken copy of each fails naming what is wrong, so the checks can fail.

No cluster and no KubeRay CRD: our own schemas (deployments/kubernetes/schemas/), the operator's
rules restated in deployments/kubernetes/check.py, and Prefect's own template validation and
resolution. What only a real cluster shows is listed in docs/operations.md.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from deployments.images import LOCK, image_reference, lock_hash
from deployments.kubernetes import check, rules, work_pool

RAYJOB = check.HERE / "rayjob.yaml"
RAYCLUSTER = check.HERE / "raycluster.yaml"
RAYSERVICE = check.HERE / "rayservice.yaml"


def documents(path):
    return check.load_documents(path)


def ray_object(docs):
    return next(d for d in docs if d["kind"] in ("RayJob", "RayCluster", "RayService"))


def cluster_spec(doc):
    return {"RayJob": doc["spec"].get("rayClusterSpec"), "RayService": doc["spec"].get("rayClusterConfig")}.get(doc["kind"], doc["spec"])


def work_pool_template():
    return json.loads(work_pool.WORK_POOL_TEMPLATE.read_text())


def test_the_image_tag_is_the_lock_hash():
    assert len(lock_hash()) == 12 and int(lock_hash(), 16) >= 0
    assert image_reference() == f"prefect-ray-training:{lock_hash(LOCK)}"


@pytest.mark.parametrize("path", [RAYJOB, RAYCLUSTER, RAYSERVICE], ids=lambda p: p.name)
def test_each_manifest_validates(path):
    docs = documents(path)
    assert {d["kind"] for d in docs} >= {"PodDisruptionBudget"}
    assert check.check_documents(docs) == []
    assert cluster_spec(ray_object(docs))["rayVersion"] == rules.lock_version("ray")


def test_the_work_pool_template_validates_with_prefect():
    template = work_pool_template()
    assert work_pool.check_work_pool_template(template) == []
    # A deployment's job variables go through the same path the worker takes.
    resolved = work_pool.resolve_work_pool_template(template, {"storage_root": "s3://other/prefix", "env": {"X": "1"}})
    container = resolved["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "PIPELINE_STORAGE_ROOT", "value": "s3://other/prefix"} in container["env"]
    assert resolved["env"]["X"] == "1"


def test_the_whole_folder_passes_the_command_line_check():
    assert check.check_all() == []


# Each breakage: (file, how to break the parsed documents, words the message must hold)
def _misspell(docs):
    ray_object(docs)["spec"]["shutdownAfterJobFinish"] = ray_object(docs)["spec"].pop("shutdownAfterJobFinishes")


def _misspell_deep(docs):
    head = cluster_spec(ray_object(docs))["headGroupSpec"]["template"]["spec"]
    head["terminationGracePeriod"] = head.pop("terminationGracePeriodSeconds")


def _ttl_without_shutdown(docs):
    ray_object(docs)["spec"]["shutdownAfterJobFinishes"] = False


def _wrong_ray_version(docs):
    cluster_spec(ray_object(docs))["rayVersion"] = "2.59.0"


def _image_not_the_lock_hash(docs):
    cluster_spec(ray_object(docs))["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] = (
        "registry.example.com/prefect-ray-training:0123456789ab"
    )


def _short_grace(docs):
    cluster_spec(ray_object(docs))["workerGroupSpecs"][0]["template"]["spec"]["terminationGracePeriodSeconds"] = 60


def _secret_in_the_file(docs):
    env = cluster_spec(ray_object(docs))["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    env[:] = [v for v in env if v["name"] != "AWS_SECRET_ACCESS_KEY"] + [{"name": "AWS_SECRET_ACCESS_KEY", "value": "hunter2"}]


def _no_budget(docs):
    docs[:] = [d for d in docs if d["kind"] != "PodDisruptionBudget"]


def _budget_misses_the_head(docs):
    budget = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "ray-worker"


def _budget_takes_the_workers_too(docs):
    budget = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    del budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]


def _long_name(docs):
    ray_object(docs)["metadata"]["name"] = "mnist-train-" + "x" * 40


# A RayService's breakages: its spec, and its serveConfigV2 (parsed, edited and written back as the YAML string it is).
def _misspell_service(docs):
    spec = ray_object(docs)["spec"]
    spec["rayClusterDeletionDelaySecond"] = spec.pop("rayClusterDeletionDelaySeconds")


def _serve_config(docs, edit):
    spec = ray_object(docs)["spec"]
    config = yaml.safe_load(spec["serveConfigV2"])
    edit(config["applications"][0])
    spec["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)


def _serve_config_not_yaml(docs):
    ray_object(docs)["spec"]["serveConfigV2"] += "      args: {storage_root: s3://mnist-artifacts/mnist\n"


def _import_path_no_module(docs):
    _serve_config(docs, lambda app: app.update(import_path="deployments.serve_modle:build"))


def _import_path_no_attribute(docs):
    _serve_config(docs, lambda app: app.update(import_path="deployments.serve_model:buld"))


def _unknown_build_arg(docs):
    _serve_config(docs, lambda app: app["args"].update(storage_rot="s3://mnist-artifacts/mnist"))


def _storage_root_on_the_pod(docs):
    _serve_config(docs, lambda app: app["args"].update(storage_root="storage"))


def _misspelt_deployment_option(docs):
    _serve_config(docs, lambda app: app["deployments"][0].update(num_replica=app["deployments"][0].pop("num_replicas")))


def _no_such_deployment(docs):
    _serve_config(docs, lambda app: app["deployments"][0].update(name="Champion"))


def _no_serve_port(docs):
    _head(docs)["ports"] = [port for port in _head(docs)["ports"] if port["name"] != "serve"]


def _bad_build_values(docs):
    _serve_config(docs, lambda app: app["args"].update(model="MNIST_resnet18", version="latest", follow_every_s="soon"))


def _initializing_timeout_not_a_duration(docs):
    ray_object(docs)["metadata"]["annotations"] = {"ray.io/initializing-timeout": "ten minutes"}


def _incremental_upgrade_without_options(docs):
    ray_object(docs)["spec"]["upgradeStrategy"]["type"] = "NewClusterWithIncrementalUpgrade"


def _long_service_name(docs):
    ray_object(docs)["metadata"]["name"] = "mnist-serve-" + "x" * 36  # 48: a RayCluster could have it, not a RayService


BREAKAGES = [
    (RAYJOB, _misspell, ["shutdownAfterJobFinish", "Additional properties"]),
    (RAYCLUSTER, _misspell_deep, ["terminationGracePeriod", "Additional properties"]),
    (RAYJOB, _ttl_without_shutdown, ["ttlSecondsAfterFinished", "shutdownAfterJobFinishes: true"]),
    (RAYJOB, _wrong_ray_version, ["rayVersion", "'2.59.0'", "lock's ray '2.60.0'"]),
    (RAYCLUSTER, _wrong_ray_version, ["rayVersion", "'2.59.0'"]),
    (RAYJOB, _image_not_the_lock_hash, ["image", "0123456789ab", image_reference()]),
    (RAYCLUSTER, _short_grace, ["terminationGracePeriodSeconds", "60", "drain", "checkpoint upload", "90 s"]),
    (RAYJOB, _secret_in_the_file, ["AWS_SECRET_ACCESS_KEY", "Secret"]),
    (RAYJOB, _no_budget, ["PodDisruptionBudget", "head"]),
    (RAYCLUSTER, _budget_misses_the_head, ["no PodDisruptionBudget", "selects its head"]),
    (RAYJOB, _budget_takes_the_workers_too, ["PodDisruptionBudget mnist-train-head", "also selects worker pods"]),
    (RAYJOB, _long_name, ["metadata.name", "47"]),
    (RAYSERVICE, _misspell_service, ["RayService spec", "rayClusterDeletionDelaySecond", "Additional properties"]),
    (RAYSERVICE, _serve_config_not_yaml, ["RayService spec.serveConfigV2: not YAML", "Ray Serve's config"]),
    (RAYSERVICE, _import_path_no_module, ["applications[0].import_path", "'deployments.serve_modle:build'", "no module"]),
    (RAYSERVICE, _import_path_no_attribute, ["applications[0].import_path", "deployments/serve_model.py defines no buld"]),
    (RAYSERVICE, _unknown_build_arg, ["applications[0].args", "['storage_rot'] unknown to deployments.serve_model:build",
                                      "follow_every_s, model, storage_root, version"]),
    (RAYSERVICE, _storage_root_on_the_pod, ["applications[0].args.storage_root", "s3://"]),
    (RAYSERVICE, _misspelt_deployment_option, ["deployments[0]", "num_replica", "serve-config.schema.json"]),
    (RAYSERVICE, _no_such_deployment, ["deployments[0].name 'Champion'", "ChampionEndpoint"]),
    (RAYSERVICE, _no_serve_port, ["containers[0].ports", "no port named 'serve'", "-serve-svc"]),
    (RAYSERVICE, _bad_build_values, ["args.model 'MNIST_resnet18'", "args.version 'latest'", "args.follow_every_s 'soon'"]),
    (RAYSERVICE, _initializing_timeout_not_a_duration, ["ray.io/initializing-timeout", "'ten minutes'", "positive duration"]),
    (RAYSERVICE, _incremental_upgrade_without_options, ["spec.upgradeStrategy", "enableInTreeAutoscaling", "clusterUpgradeOptions"]),
    (RAYSERVICE, _long_service_name, ["RayService metadata.name", "47"]),
    (RAYSERVICE, _wrong_ray_version, ["RayService spec.rayClusterConfig.rayVersion", "'2.59.0'", "lock's ray '2.60.0'"]),
    (RAYSERVICE, _image_not_the_lock_hash, ["spec.rayClusterConfig.workerGroupSpecs[0]", "0123456789ab"]),
    (RAYSERVICE, _short_grace, ["spec.rayClusterConfig.workerGroupSpecs[0]", "terminationGracePeriodSeconds", "90 s"]),
    (RAYSERVICE, _secret_in_the_file, ["RayService mnist-serve", "AWS_SECRET_ACCESS_KEY", "Secret"]),
    (RAYSERVICE, _no_budget, ["RayService mnist-serve: no PodDisruptionBudget", "head"]),
]


@pytest.mark.parametrize(
    ("path", "breaking", "words"), BREAKAGES, ids=[f"{path.stem}-{breaking.__name__.strip('_')}" for path, breaking, _ in BREAKAGES]
)
def test_a_broken_manifest_fails_naming_the_problem(path, breaking, words):
    docs = copy.deepcopy(documents(path))
    breaking(docs)
    problems = check.check_documents(docs)
    assert problems, f"{breaking.__name__} passed the checks"
    text = "\n".join(problems)
    assert all(word in text for word in words), text


def test_a_ttl_with_shutdown_is_fine_and_zero_ttl_needs_none():
    docs = copy.deepcopy(documents(RAYJOB))
    spec = ray_object(docs)["spec"]
    spec["shutdownAfterJobFinishes"], spec["ttlSecondsAfterFinished"] = False, 0  # the operator's own rule: only TTL > 0
    assert check.check_documents(docs) == []


def test_a_new_lock_fails_the_image_and_version_checks(tmp_path):
    """When the lock moves on, the manifests must follow: a changed lock is a new image tag."""
    lock = tmp_path / "requirements.lock"
    lock.write_text(LOCK.read_text().replace("ray==2.60.0", "ray==2.61.0"))
    problems = "\n".join(check.check_documents(documents(RAYJOB), lock))
    assert "lock's ray '2.61.0'" in problems and lock_hash(lock) in problems


def test_a_broken_work_pool_template_fails_in_prefects_own_check():
    template = work_pool_template()
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    container["serviceAccountName"] = "{{ service_acount_name }}"  # misspelt: no such variable
    problems = work_pool.check_work_pool_template(template)
    assert len(problems) == 1 and "Prefect refuses it" in problems[0] and "service_acount_name" in problems[0]


@pytest.mark.parametrize(
    ("breaking", "words"),
    [
        (lambda t: t["variables"]["properties"]["image"].update(default="prefect-ray-training:latest"), ["image", "latest"]),
        (lambda t: t["variables"]["properties"]["backoff_limit"].update(default="zero"), ["defaults", "zero"]),
        (lambda t: t["job_configuration"].update(job_manifests=t["job_configuration"]["job_manifest"]), ["job_manifests", "xtra"]),
        (
            lambda t: t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"].update(restartPolicy="OnFailure"),
            ["restartPolicy", "Never"],
        ),
        (lambda t: t["variables"]["properties"]["env"]["default"].update(AWS_SECRET_ACCESS_KEY="hunter2"), ["AWS_SECRET_ACCESS_KEY"]),
    ],
    ids=["image-tag", "default-of-wrong-type", "misspelt-key", "restart-policy", "secret-in-env"],
)
def test_a_broken_work_pool_template_fails_naming_the_problem(breaking, words):
    template = work_pool_template()
    breaking(template)
    text = "\n".join(work_pool.check_work_pool_template(template))
    assert text and all(word in text for word in words), text


# The command line: a path (a file or a folder), --help, exit 2 for a path that is not there.
def run_check(capsys, *argv):
    code = check.main([str(arg) for arg in argv])
    return code, capsys.readouterr().out


def write_manifest(folder, docs, name="rayjob.yaml"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return folder / name


def test_help_exits_0_and_shows_the_usage():
    done = subprocess.run(
        [sys.executable, "-m", "deployments.kubernetes.check", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m deployments.kubernetes.check [-h] [path]"), done.stdout
    assert "a manifest file or a folder" in done.stdout and "ok:" not in done.stdout


@pytest.mark.parametrize(("make", "words"), [(None, "no such file or folder"), ("empty", "no manifests")])
def test_a_path_that_holds_no_manifest_exits_2_naming_it(tmp_path, capsys, make, words):
    path = tmp_path / "manifests"
    if make:
        path.mkdir()
    with pytest.raises(SystemExit) as stopped:
        check.main([str(path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and words in err and str(path) in err, err


@pytest.mark.parametrize("argv", [[], [check.HERE], [RAYJOB]], ids=["default", "folder", "file"])
def test_the_shipped_manifests_pass_the_command_line_check(capsys, argv):
    code, out = run_check(capsys, *argv)
    names = ["rayjob.yaml"] if argv == [RAYJOB] else ["prefect-work-pool.json", "raycluster.yaml", "rayjob.yaml", "rayservice.yaml"]
    assert code == 0 and out.startswith("ok: ") and all(name in out for name in names), out


def test_a_folder_with_a_bad_manifest_fails_naming_the_file(tmp_path, capsys):
    docs = copy.deepcopy(documents(RAYJOB))
    _wrong_ray_version(docs)
    bad = write_manifest(tmp_path / "manifests", docs, "bad-job.yaml")
    write_manifest(tmp_path / "manifests", documents(RAYCLUSTER), "good-cluster.yaml")
    code, out = run_check(capsys, bad.parent)
    problems = out.splitlines()[:-1]
    assert code == 1 and problems and all(line.startswith(f"{bad}: RayJob") for line in problems), out
    assert "rayVersion: '2.59.0'" in out and out.splitlines()[-1].startswith(f"{len(problems)} problem(s) in"), out
    assert "good-cluster.yaml" in out.splitlines()[-1]


# A credential written inline: (where it goes, the secret, words the message must hold). Each secret
# is made up; the AWS key id and the key block are put together here so no scanner takes them for real.
FAKE_KEY_ID = "AKIA" + "Z7EXAMPLEKEY4242"
FAKE_KEY_BLOCK = "-----BEGIN RSA " + "PRIVATE KEY-----\nMIIEowIBAAKCAQEAq8hunter2Zq8\n-----END RSA PRIVATE KEY-----"


def _head(docs):
    return cluster_spec(ray_object(docs))["headGroupSpec"]["template"]["spec"]["containers"][0]


def _worker(docs):
    return cluster_spec(ray_object(docs))["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _entrypoint(docs, text):
    ray_object(docs)["spec"]["entrypoint"] = text


def _command(docs, text):
    _head(docs)["command"] = ["/bin/sh", "-c", text]


def _args(docs, text):
    _worker(docs)["args"] = text.split(" ")


def _env_value(docs, text):
    _head(docs)["env"] = [*_head(docs)["env"], {"name": "RUN_DATABASE", "value": text}]


HEAD = "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0]"
WORKER = "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0]"
INLINE = [
    (_entrypoint, "AWS_SECRET_ACCESS_KEY={} python -m flows.mnist", "Zq8-hunter2-wX", ["spec.entrypoint: ", "AWS_SECRET_ACCESS_KEY=<redacted>"]),
    (_entrypoint, "python -m flows.mnist --mlflow-token={}", "Zq8-hunter2-wX", ["spec.entrypoint: ", "--mlflow-token=<redacted>"]),
    (_command, "curl -H 'Authorization: Bearer {}' http://x && ray start", "eyJhbGciOi.Zq8", [f"{HEAD}.command: ", "Bearer <redacted>"]),
    (_command, "export AWS_ACCESS_KEY_ID={} && ray start", FAKE_KEY_ID, [f"{HEAD}.command: ", "an AWS access key id"]),
    (_args, "--address auto --password {}", "Zq8-hunter2-wX", [f"{WORKER}.args: ", "--password <redacted>"]),
    (_args, "--storage token={}", "Zq8-hunter2-wX", [f"{WORKER}.args: ", "token=<redacted>"]),
    (_env_value, "postgresql://mnist:{}@db:5432/runs", "Zq8-hunter2-wX", [f"{HEAD}.env[5].value (RUN_DATABASE): ", "postgresql:// URL"]),
    (_env_value, "{}", FAKE_KEY_BLOCK, [f"{HEAD}.env[5].value (RUN_DATABASE): ", "a private key block"]),
]


@pytest.mark.parametrize(
    ("put", "text", "secret", "words"), INLINE, ids=[f"{put.__name__.strip('_')}-{i}" for i, (put, *_) in enumerate(INLINE)]
)
def test_an_inline_credential_fails_naming_the_field_never_the_value(tmp_path, capsys, put, text, secret, words):
    docs = copy.deepcopy(documents(RAYJOB))
    put(docs, text.format(secret))
    path = write_manifest(tmp_path, docs)
    code, out = run_check(capsys, path)
    assert code == 1 and f"{path}: RayJob mnist-train " in out and "an inline credential" in out, out
    assert all(word in out for word in words), out
    assert secret not in out and secret.splitlines()[-1] not in out and "hunter2" not in out, out


@pytest.mark.parametrize(
    ("put", "text"),
    [
        (_entrypoint, "python -m flows.mnist --password=$(RUN_PASSWORD) --token ${RUN_TOKEN}"),
        (_command, "curl -H \"Authorization: Bearer $(RAY_AUTH_TOKEN)\" http://x; ray start"),
        (_args, "--storage-credentials-file /var/run/secrets/s3 --ray-token-path /var/run/secrets/ray"),
        (_env_value, "postgresql://mnist:$(RUN_DB_PASSWORD)@db:5432/runs"),
    ],
    ids=["entrypoint", "command", "args", "env-value"],
)
def test_a_reference_to_a_credential_passes(tmp_path, capsys, put, text):
    docs = copy.deepcopy(documents(RAYJOB))
    put(docs, text)
    code, out = run_check(capsys, write_manifest(tmp_path, docs))
    assert code == 0 and out.startswith("ok: "), out


def test_a_credential_in_the_work_pool_command_fails_without_its_value():
    template = work_pool_template()
    template["variables"]["properties"]["command"]["default"] = "python -m flows.mnist --password=Zq8-hunter2-wX"
    text = "\n".join(work_pool.check_work_pool_template(template))
    assert "work-pool template (resolved) job_manifest.spec.template.spec.containers[0].args" in text, text
    assert "--password=<redacted>" in text and "hunter2" not in text, text


# Issue 60: credentials in the places the first check did not look. Each (how to put the secret in the
# parsed documents, the secret, words the output must hold); the secret itself must never be printed.
LOCK_IMAGE = image_reference()
SECRET = "Zq8hunter2wXk"  # no '-': it must survive a label value's and an image reference's syntax


def _image_with_a_token(docs, secret):
    _head(docs)["image"] = f"deploy:{secret}@registry.example.com/{LOCK_IMAGE}"


def _image_with_a_token_and_a_bad_tag(docs, secret):
    _worker(docs)["image"] = f"deploy:{secret}@registry.example.com/prefect-ray-training:0123456789ab"


def _annotation(docs, secret):
    ray_object(docs)["metadata"]["annotations"] = {"example.com/api-token": secret}


def _annotation_url(docs, secret):
    ray_object(docs)["metadata"]["annotations"] = {"example.com/dashboard": f"https://grafana.example.com/d/x?sig={secret}"}


def _label(docs, secret):
    cluster_spec(ray_object(docs))["workerGroupSpecs"][0]["template"]["metadata"]["labels"]["ray-token"] = secret


def _ray_start_params(docs, secret):
    cluster_spec(ray_object(docs))["headGroupSpec"]["rayStartParams"]["redis-password"] = secret


def _ray_start_params_not_a_string(docs, secret):
    """A number where the schema wants a string: the schema's message would echo it."""
    cluster_spec(ray_object(docs))["headGroupSpec"]["rayStartParams"]["redis-password"] = int(secret)


def _config_map(docs, secret):
    docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "run-settings"},
                 "data": {"PIPELINE_TRAIN__EPOCHS": "3", "MLFLOW_TRACKING_TOKEN": secret}})


def _config_map_used_by_env_from(docs, secret):
    _config_map(docs, secret)
    _head(docs)["envFrom"] = [{"configMapRef": {"name": "run-settings"}}]


def _secret_string_data(docs, secret):
    docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pipeline-s3-credentials"}, "type": "Opaque",
                 "stringData": {"AWS_ACCESS_KEY_ID": "minio", "AWS_SECRET_ACCESS_KEY": secret}})


def _secret_data(docs, secret):
    import base64

    docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pipeline-s3-credentials"},
                 "data": {"AWS_SECRET_ACCESS_KEY": base64.b64encode(secret.encode()).decode()}})


def _env_url_auth(docs, secret):
    _head(docs)["env"] = [*_head(docs)["env"], {"name": "RUN_REPORTS", "value": f"https://x.example.com/?auth={secret}"}]


def _args_url_key(docs, secret):
    _worker(docs)["args"] = ["--webhook", f"https://hooks.example.com/in?key={secret}&channel=runs"]


CLUSTER = "spec.rayClusterSpec"
HIDDEN = [
    (_image_with_a_token, SECRET, [f"RayJob mnist-train {HEAD}.image: ", "<redacted>@registry.example.com"]),
    (_image_with_a_token_and_a_bad_tag, SECRET, [f"{WORKER}.image", "0123456789ab", "<redacted>@registry.example.com"]),
    (_annotation, SECRET, ["RayJob mnist-train metadata.annotations.example.com/api-token", "Secret"]),
    (_annotation_url, SECRET, ["metadata.annotations.example.com/dashboard", "sig=<redacted>"]),
    (_label, SECRET, [f"{CLUSTER}.workerGroupSpecs[0].template.metadata.labels.ray-token"]),
    (_ray_start_params, SECRET, [f"{CLUSTER}.headGroupSpec.rayStartParams.redis-password"]),
    (_ray_start_params_not_a_string, "4242424242", [f"{CLUSTER}.headGroupSpec.rayStartParams.redis-password", "<redacted>"]),
    (_config_map, SECRET, ["ConfigMap run-settings data.MLFLOW_TRACKING_TOKEN", "Secret"]),
    (_config_map_used_by_env_from, SECRET, [f"{HEAD}.envFrom[0].configMapRef run-settings", "MLFLOW_TRACKING_TOKEN"]),
    (_secret_string_data, SECRET, ["Secret pipeline-s3-credentials stringData", "an inline Secret", "AWS_SECRET_ACCESS_KEY"]),
    (_secret_data, SECRET, ["Secret pipeline-s3-credentials data", "an inline Secret"]),
    (_env_url_auth, SECRET, [f"{HEAD}.env[5].value (RUN_REPORTS)", "auth=<redacted>"]),
    (_args_url_key, SECRET, [f"{WORKER}.args", "key=<redacted>"]),
]


@pytest.mark.parametrize(("put", "secret", "words"), HIDDEN, ids=[put.__name__.strip("_") for put, *_ in HIDDEN])
def test_a_credential_anywhere_in_a_manifest_fails_without_its_value(tmp_path, capsys, put, secret, words):
    import base64

    docs = copy.deepcopy(documents(RAYJOB))
    put(docs, secret)
    path = write_manifest(tmp_path, docs)
    code, out = run_check(capsys, path)
    assert code == 1 and all(word in out for word in words), out
    assert secret not in out and base64.b64encode(secret.encode()).decode() not in out, out
    assert "no schema" not in out, out  # a ConfigMap, a Secret and envFrom are checked, not refused unread


def test_a_config_map_without_credentials_and_env_from_a_secret_pass(tmp_path, capsys):
    docs = copy.deepcopy(documents(RAYJOB))
    docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "run-settings", "annotations": {"note": "epochs"}},
                 "data": {"PIPELINE_TRAIN__EPOCHS": "3", "AWS_SHARED_CREDENTIALS_FILE": "/var/run/secrets/aws"}})
    _head(docs)["envFrom"] = [{"configMapRef": {"name": "run-settings"}}, {"secretRef": {"name": "pipeline-s3-credentials"}}]
    _head(docs)["env"] = [*_head(docs)["env"], {"name": "RUN_REPORTS", "value": "https://x.example.com/?page=2&sort=desc"}]
    cluster_spec(ray_object(docs))["headGroupSpec"]["rayStartParams"]["redis-password"] = "$(RAY_REDIS_PASSWORD)"
    code, out = run_check(capsys, write_manifest(tmp_path, docs))
    assert code == 0 and out.startswith("ok: "), out


def test_the_url_parameters_checked_are_the_redaction_rules():
    """deployments.kubernetes.credentials takes its secret parameter names from storage_io.redact, not a copy."""
    from deployments.kubernetes import credential_text
    from storage_io import redact

    for name in ("auth", "sig", "code", "session", "X-Amz-Signature", "api_key", "token"):
        assert redact.is_secret_name(name)
        found = credential_text.find_credentials(f"see https://h.example.com/p?{name}=Zq8hunter2wXk&page=1")
        assert found and all("Zq8hunter2wXk" not in line for line in found), (name, found)
    assert credential_text.find_credentials("https://h.example.com/p?page=1&sort=asc") == []


# A RayService's serveConfigV2: credentials in it, and the check's knowledge of Ray Serve and of build() against theirs.
def _serve_args(docs, text):
    _serve_config(docs, lambda app: app["args"].update(yaml.safe_load(text)))


def _serve_config_comment(docs, text):
    ray_object(docs)["spec"]["serveConfigV2"] += f"# {text}\n"


SERVE_ARGS = "RayService mnist-serve spec.serveConfigV2 applications[0].args"
IN_SERVE_CONFIG = [
    (_serve_args, "{{storage_root: 's3://{}:{}@mnist-artifacts/mnist'}}", [f"{SERVE_ARGS}.storage_root: ", "s3:// URL (:<redacted>@)"]),
    (_serve_args, "{{aws_secret_access_key: '{}{}'}}", [f"{SERVE_ARGS}.aws_secret_access_key: ", "aws_secret_access_key: <redacted>"]),
    (_serve_config_comment, "AWS_ACCESS_KEY_ID={} AWS_SECRET_ACCESS_KEY={}", ["RayService mnist-serve spec.serveConfigV2: ",
                                                                            "AWS_SECRET_ACCESS_KEY=<redacted>", "an AWS access key id"]),
]


@pytest.mark.parametrize(("put", "text", "words"), IN_SERVE_CONFIG, ids=["storage-root-url", "named-arg", "comment"])
def test_a_credential_in_serve_config_fails_naming_the_value_path_never_the_value(tmp_path, capsys, put, text, words):
    docs = copy.deepcopy(documents(RAYSERVICE))
    put(docs, text.format(FAKE_KEY_ID, SECRET))
    code, out = run_check(capsys, write_manifest(tmp_path, docs))
    assert code == 1 and "an inline credential" in out and "pods' env" in out and all(word in out for word in words), out
    assert SECRET not in out and FAKE_KEY_ID not in out, out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's models, on pydantic 2
def test_the_serve_config_schema_holds_only_ray_serves_fields():
    """schemas/serve-config.schema.json is our closed subset of Ray Serve's config models: every field is one of theirs."""
    from ray.serve import schema as ray_schema

    ours = json.loads((check.SCHEMAS / "serve-config.schema.json").read_text())["$defs"]
    theirs = {"ServeConfigV2": ray_schema.ServeDeploySchema, "Application": ray_schema.ServeApplicationSchema,
              "Deployment": ray_schema.DeploymentSchema, "RayActorOptions": ray_schema.RayActorOptionsSchema}
    assert set(ours) == set(theirs)
    for name, model in theirs.items():
        assert set(ours[name]["properties"]) <= set(model.model_fields), name
        assert ours[name]["additionalProperties"] is False, name
    ray_schema.ServeDeploySchema.model_validate(yaml.safe_load(ray_object(documents(RAYSERVICE))["spec"]["serveConfigV2"]))


def test_the_args_the_check_allows_are_the_ones_build_takes():
    """The check reads build's args from its source (ast, no import); build itself names the same ones when refusing."""
    import ast

    from deployments import serve_model
    from deployments.kubernetes import ray_service

    tree = ast.parse(ray_service.module_file("deployments.serve_model").read_text())
    names = ray_service.top_level_names(tree)
    takes = ray_service.builder_args(names["build"], names)
    assert takes == {"storage_root", "model", "version", "follow_every_s"}
    with pytest.raises(ValueError) as refused:
        serve_model.build({"storage_rot": "s3://x/y"})
    assert set(str(refused.value).split("it takes ")[1].split(", ")) == takes
    assert ray_service.deployment_names(tree) == {"ChampionEndpoint"} and serve_model.APP_NAME == "champion"
