"""Running generated Python in a separate, limited process: the one sandbox behind the
execution-based metrics (`fs_plugins.metrics.execution`: DoIT's pass@1, GSM-Hard's execution
accuracy).

This is PROCESS ISOLATION WITH LIMITS, NOT A SECURITY BOUNDARY. It keeps a wrong or runaway
program (an infinite loop, a huge allocation, a stray file write, a subprocess) from disturbing
the evaluation, and keeps the evaluating process's secrets out of the program's sight; it does
not stop a program written to escape (a kernel or interpreter exploit). Evaluating a model you
do not trust calls for a container or VM without network around the whole run, or for
execution switched off (below).

Each program runs in:
- a fresh interpreter, `python -I` (isolated mode: PYTHON* variables, the user site and the
  current directory are ignored), started in its own session so that the whole process group
  is killed on timeout;
- a new temporary working directory, removed afterwards; stdout / stderr go to files there;
- an environment made from scratch (PATH, LANG, HOME = TMPDIR = the working directory, one
  BLAS thread): nothing of the evaluating process's environment (tokens, keys) is passed on;
- resource limits set by the child on itself before the program starts (`resource.setrlimit`):
  CPU seconds, address space, file size, open files, no core files, and no new processes
  (RLIMIT_NPROC; the superuser is exempt from that one, the audit hook below is not);
- a Python audit hook (`sys.addaudithook`, which Python code cannot remove) installed before the
  program runs, refusing with PermissionError: opening for writing, creating, removing, renaming
  or changing anything outside the working directory; reading or listing outside the working
  directory and the interpreter's own installation (its prefixes and import path), so files
  such as ~/.ssh or /proc/<pid>/environ of other processes cannot be read; starting processes
  (subprocess, os.system, exec, spawn, fork); sockets; ctypes (which could undo the rest);
  signals to other processes;
- a wall-clock timeout enforced by the parent (SIGKILL to the process group).

Switches: FSPLUG_CODE_EXECUTION=0 (or `set_execution_enabled(False)`) turns execution off: the
execution metrics then report nan instead of running anything. FSPLUG_SANDBOX_TIMEOUT (seconds),
FSPLUG_SANDBOX_MEMORY_MB and FSPLUG_SANDBOX_WORKERS (programs run at once) change the defaults
of `SandboxLimits` / `run_many`. POSIX only (the `resource` module).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)

ENV_SWITCH = 'FSPLUG_CODE_EXECUTION'
MODES = ('tests', 'notebook')
_OFF_WORDS = ('0', 'false', 'no', 'off')
_enabled_override: bool | None = None


def _env_number(name: str, default: float) -> float:
    value = os.environ.get(name, '').strip()
    try:
        return float(value) if value else default
    except ValueError:
        raise ValueError(f'{name} = {value!r} is not a number') from None


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program run (defaults overridable by the FSPLUG_SANDBOX_* variables)."""
    timeout_s: float = field(default_factory=lambda: _env_number('FSPLUG_SANDBOX_TIMEOUT', 10.0))
    cpu_s: int = 0                       # RLIMIT_CPU; 0 = ceil(timeout_s)
    memory_mb: int = field(default_factory=lambda: int(_env_number('FSPLUG_SANDBOX_MEMORY_MB', 2048)))
    file_mb: int = 16                    # RLIMIT_FSIZE: largest file the program may write
    open_files: int = 64                 # RLIMIT_NOFILE
    max_output_chars: int = 20_000       # stdout / stderr kept in the result


@dataclass
class SandboxResult:
    """status: 'ok' (the program, and the tests, ran to the end), 'error' (an exception or a
    non-zero exit), 'timeout' (killed at the wall-clock limit), 'killed' (ended by a signal:
    the CPU or file-size limit), 'disabled' (execution is off: nothing ran)."""
    status: str
    returncode: int | None = None
    stdout: str = ''
    stderr: str = ''
    value: object = None                 # notebook mode: solution()'s value (float or text)
    last_output: str = ''                # notebook mode: output of the last cell that printed (no error)

    @property
    def ok(self) -> bool:
        return self.status == 'ok'


def set_execution_enabled(enabled: bool | None) -> None:
    """Overrides FSPLUG_CODE_EXECUTION for this process (None: back to the variable)."""
    global _enabled_override
    _enabled_override = enabled


def execution_enabled() -> bool:
    """Whether programs may run: on unless FSPLUG_CODE_EXECUTION is 0 / false / no / off (or
    `set_execution_enabled(False)`); always off where `resource` is missing (not POSIX)."""
    if _enabled_override is not None:
        wanted = _enabled_override
    else:
        wanted = os.environ.get(ENV_SWITCH, '1').strip().lower() not in _OFF_WORDS
    return wanted and _has_resource()


def _has_resource() -> bool:
    try:
        import resource  # noqa: F401  # lazy: POSIX only
    except ImportError:
        return False
    return True


def child_environment(workdir: str) -> dict[str, str]:
    """The program's whole environment (nothing inherited)."""
    return {'PATH': '/usr/local/bin:/usr/bin:/bin', 'LANG': 'C.UTF-8', 'LC_ALL': 'C.UTF-8',
            'HOME': workdir, 'TMPDIR': workdir, 'PYTHONIOENCODING': 'utf-8',
            'OMP_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1',
            # what importing fs_plugins would set (core.threads): the program's own environment
            'OMP_WAIT_POLICY': 'PASSIVE', 'FSPLUG_NO_AUTOLOAD': '1'}


def run_python(code: str | list[str], *, tests: str = '', entry_point: str = '', mode: str = 'tests',
               limits: SandboxLimits | None = None) -> SandboxResult:
    """Runs one program in the sandbox.

    mode 'tests' (pass@1): `code`, then `tests` in the same namespace, then
    `check(<entry_point>)` when the tests define `check` without calling it (HumanEval style);
    'ok' only when all of it ran to the end (a SystemExit or os._exit before the end fails:
    the runner's closing report, marked with a per-run nonce, is then missing; a program that
    digs the nonce out of the runner's frames could forge it: not a security boundary).
    mode 'notebook' (execution accuracy): `code` is a list of blocks run one after another in
    one namespace, as notebook cells: an error ends its cell only, a cell's last expression is
    printed; then `solution()` is called when the program defines it. `value` is its result,
    `last_output` what the last cell that ran without error and printed anything printed."""
    if mode not in MODES:
        raise ValueError(f'mode {mode!r} is not one of {MODES}')
    if not execution_enabled():
        return SandboxResult('disabled')
    limits = limits or SandboxLimits()
    nonce = secrets.token_hex(16)
    blocks = list(code) if isinstance(code, list | tuple) else [code]
    job = {'nonce': nonce, 'mode': mode, 'blocks': blocks, 'tests': tests, 'entry_point': entry_point,
           'limits': asdict(limits)}
    workdir = tempfile.mkdtemp(prefix='fsplug_sandbox_')
    try:
        return _run_in(workdir, job, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(workdir: str, job: dict, limits: SandboxLimits) -> SandboxResult:
    out_path, err_path = os.path.join(workdir, '.stdout'), os.path.join(workdir, '.stderr')
    with open(out_path, 'wb') as out, open(err_path, 'wb') as err:
        process = subprocess.Popen([sys.executable, '-I', '-c', RUNNER], cwd=workdir,
                                   env=child_environment(workdir), stdin=subprocess.PIPE,
                                   stdout=out, stderr=err, start_new_session=True, close_fds=True)
        status = None
        try:
            process.communicate(json.dumps(job).encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            status = 'timeout'
            _kill_group(process)
            process.wait()
    (stdout, tail), (stderr, _) = _read(out_path, limits.max_output_chars), _read(err_path, limits.max_output_chars)
    report = _report(tail, job['nonce'])
    stdout = '\n'.join(line for line in stdout.splitlines() if not line.startswith(job['nonce']))
    returncode = process.returncode
    if status is None:
        if returncode is not None and returncode < 0:
            status = 'killed'
        elif returncode == 0 and report is not None and report.get('ok'):
            status = 'ok'
        else:
            status = 'error'
    report = report or {}
    return SandboxResult(status, returncode, stdout, stderr, report.get('value'), report.get('last_output', ''))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()


def _read(path: str, limit: int) -> tuple[str, str]:
    """(the file's text cut to `limit` characters, its last 64 KiB: where the report is)."""
    try:
        with open(path, 'rb') as handle:
            head = handle.read(4 * limit + 4096).decode('utf-8', errors='replace')
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - (64 << 10)))
            tail = handle.read().decode('utf-8', errors='replace')
    except OSError:
        return '', ''
    if len(head) <= limit and len(tail) <= len(head):
        return head, tail
    return head[:limit // 2] + '\n...\n' + tail[-(limit // 2):], tail


def _report(stdout: str, nonce: str) -> dict | None:
    """The runner's closing report (the last line that starts with the run's nonce)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce):
            try:
                return json.loads(line[len(nonce):])
            except json.JSONDecodeError:
                return None
    return None


def run_many(jobs: list[dict], limits: SandboxLimits | None = None, workers: int = 0) -> list[SandboxResult]:
    """`run_python(**job)` for each job, `workers` at a time (0: FSPLUG_SANDBOX_WORKERS, else
    min(4, CPUs)); results in job order."""
    if not jobs:
        return []
    if not execution_enabled():
        return [SandboxResult('disabled') for _ in jobs]
    workers = workers or int(_env_number('FSPLUG_SANDBOX_WORKERS', min(4, os.cpu_count() or 1)))
    if workers <= 1:
        return [run_python(**job, limits=limits) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_python(**job, limits=limits), jobs))


# The child's side: read the job from stdin, limit itself, install the audit hook, run. Kept
# as source text run with `python -I -c` (nothing to import from this package in the child).
RUNNER = r'''
import ast, builtins, contextlib, io, json, math, os, resource, sys, traceback

job = json.loads(sys.stdin.read())
sys.stdin = io.StringIO('')
limits = job['limits']
MB = 1 << 20
cpu = int(limits['cpu_s']) or int(math.ceil(float(limits['timeout_s'])))
for name, value in (('RLIMIT_CPU', cpu), ('RLIMIT_AS', int(limits['memory_mb']) * MB),
                    ('RLIMIT_FSIZE', int(limits['file_mb']) * MB), ('RLIMIT_CORE', 0),
                    ('RLIMIT_NOFILE', int(limits['open_files'])), ('RLIMIT_NPROC', 0)):
    if hasattr(resource, name):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            pass

HOME = os.path.realpath(os.getcwd())
READ_ROOTS = {HOME}
for root in [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]:
    if root and os.path.isabs(root):
        root = os.path.realpath(root)
        if root != os.sep:
            READ_ROOTS.add(root)
READ_FILES = {'/dev/null', '/dev/urandom', '/dev/random', '/dev/zero', '/etc/localtime'}
READ_ROOTS.add('/usr/share/zoneinfo')
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DENIED = {'subprocess.Popen', 'os.system', 'os.exec', 'os.posix_spawn', 'os.spawn', 'os.fork',
          'os.forkpty', 'os.startfile', 'pty.spawn', 'socket.__new__', 'socket.connect',
          'socket.bind', 'socket.getaddrinfo', 'socket.gethostbyname', 'urllib.Request',
          'ctypes.dlopen', 'ctypes.dlsym', 'ctypes.cdata', 'ctypes.call_function',
          'ctypes.string_at', 'ctypes.wstring_at', 'ctypes.set_errno', 'ctypes.set_exception',
          'os.kill', 'os.killpg', 'signal.pthread_kill', 'os.setuid', 'os.chroot'}
PATH_WRITES = {'os.remove', 'os.rename', 'os.rmdir', 'os.mkdir', 'os.chmod', 'os.chown',
               'os.link', 'os.symlink', 'os.truncate', 'os.utime', 'shutil.rmtree',
               'shutil.copyfile', 'shutil.copytree', 'shutil.move', 'os.chdir', 'os.setxattr',
               'os.removexattr'}
PATH_READS = {'os.listdir', 'os.scandir', 'glob.glob', 'os.listxattr', 'os.getxattr'}


def _inside(path, roots):
    try:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        full = os.path.realpath(os.path.join(HOME, os.fspath(path)))
    except (TypeError, ValueError):
        return False
    return any(full == root or full.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _readable(path):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return str(path) in READ_FILES or _inside(path, READ_ROOTS)


def hook(event, args):
    if event in DENIED:
        raise PermissionError(f'sandbox: {event} is not allowed')
    if event == 'open':
        path, flags = args[0], args[2] if len(args) > 2 else 0
        if isinstance(path, int):
            return
        if isinstance(flags, int) and flags & WRITE_FLAGS:
            if not _inside(path, {HOME}):
                raise PermissionError(f'sandbox: writing outside the working directory: {path}')
        elif isinstance(args[1], str) and any(c in args[1] for c in 'wax+'):
            if not _inside(path, {HOME}):
                raise PermissionError(f'sandbox: writing outside the working directory: {path}')
        elif not _readable(path):
            raise PermissionError(f'sandbox: reading outside the sandbox: {path}')
    elif event in PATH_WRITES:
        for path in args:
            if isinstance(path, str | bytes | os.PathLike) and not _inside(path, {HOME}):
                raise PermissionError(f'sandbox: {event} outside the working directory: {path}')
    elif event in PATH_READS and args and isinstance(args[0], str | bytes | os.PathLike):
        if not _readable(args[0]):
            raise PermissionError(f'sandbox: {event} outside the sandbox: {args[0]}')


def reporter(nonce):
    def report(**fields):
        sys.stdout.flush()
        os.write(1, ('\n' + nonce + json.dumps(fields) + '\n').encode())
    return report


report = reporter(job.pop('nonce'))


def as_value(value):
    if value is None:
        return None
    try:
        number = float(value)
        if math.isfinite(number):
            return number
    except Exception:
        pass
    try:
        return str(value)[:200]
    except Exception:
        return None


def run_cell(source, namespace):
    """A notebook cell: its statements, then its last expression's value printed."""
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, '<cell>', 'exec'), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), '<cell>', 'eval'), namespace)
        if value is not None:
            print(repr(value))


sys.dont_write_bytecode = True
# ctypes is imported before the hook (numpy and sympy import it); loading libraries or symbols,
# calling foreign functions and reading raw addresses are refused afterwards, and its raw
# memory helpers are removed. It can still corrupt the process's own memory (pointer
# indexing): one of the reasons this is not a security boundary.
import ctypes


def _refused(*args, **kwargs):
    raise PermissionError('sandbox: raw memory access through ctypes is not allowed')


for _name in ('memmove', 'memset', 'cast', 'string_at', 'wstring_at'):
    setattr(ctypes, _name, _refused)
sys.addaudithook(hook)
namespace = {'__name__': '__main__', '__builtins__': builtins}
if job['mode'] == 'tests':
    try:
        exec(compile('\n'.join(job['blocks']), '<program>', 'exec'), namespace)
        if job['tests']:
            exec(compile(job['tests'], '<tests>', 'exec'), namespace)
        entry = job['entry_point']
        if entry and callable(namespace.get('check')) and 'check(' not in job['tests'].replace('def check(', ''):
            namespace['check'](namespace[entry])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    report(ok=True)
else:
    last_output = ''
    for block in job['blocks']:
        buffer, failed = io.StringIO(), False
        try:
            with contextlib.redirect_stdout(buffer):
                run_cell(block, namespace)
        except BaseException as exc:
            buffer.write(f'{type(exc).__name__}: {exc}\n')
            failed = True
        text = buffer.getvalue()
        sys.stdout.write(text)
        if text.strip() and not failed:
            last_output = text
    value = None
    solution = namespace.get('solution')
    if callable(solution):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                value = as_value(solution())
        except BaseException:
            traceback.print_exc()
    report(ok=True, value=value, last_output=last_output[-4000:])
sys.stdout.flush()
os._exit(0)
'''
