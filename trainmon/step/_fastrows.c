/* The step buffer's row of a hooked tensor that joins a Triton batch, without the interpreter.

   StepBuffer.add -> TritonReducer.row -> TritonReducer._defer runs for every activation, activation gradient
   and (undistributed) gradient a hook sees: ~18k machine instructions a row in Python, most of it bytecode.
   FastRows.add does the same for the usual case in C and returns True; whenever anything is unusual (a row
   description not seen before, a tensor that is not contiguous, the learning step, a tensor read at its
   hook, a full store, capture or held tensors, the kernels off) it changes nothing and returns False, and
   the Python path runs. The Python path stays the reference: tests run both and compare.

   Plain CPython API, no torch headers (tensor attributes are read as Python attributes), so one build runs
   with any torch. State lives in the Python objects (read through their __dict__ at every call), so the
   Python code sees every change this makes and nothing here goes stale. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *buffer;     /* StepBuffer.__dict__ */
    PyObject *store;      /* _DeviceStore.__dict__ */
    PyObject *reducer;    /* TritonReducer.__dict__ */
    PyObject *flush;      /* TritonReducer._flush, bound */
    PyObject *module;     /* trainmon.stats.triton_path.__dict__ */
    PyObject *codes;      /* dtype -> (stats_batch tag, itemsize) */
    PyObject *strided;    /* torch.strided */
    PyObject *no_collectives;
    PyObject *batch;      /* the _Batch */
    PyObject *tensors, *rows, *versions, *addresses, *numels, *sites, *tags, *by_address;
    PyObject *shared_from, *shared_rows;
    long device_index;    /* -1: the CPU (Triton's interpreter) */
    PyTypeObject *tensor_type;  /* torch.Tensor: other types (subclasses) take the Python path */
    PyObject *descr[9];   /* torch.Tensor's descriptors of what a row reads (enum below) */
} FastRows;

/* the tensor attributes a row reads, called through torch.Tensor's own descriptors: the same getters and
   methods as `tensor.<name>`, without looking the name up on every call */
enum { IS_CPU, IS_CUDA, GET_DEVICE, DTYPE, LAYOUT, IS_CONTIGUOUS, SHAPE, DATA_PTR, VERSION, N_DESCR };
static const char *descr_names[N_DESCR] = {"is_cpu", "is_cuda", "get_device", "dtype", "layout",
                                           "is_contiguous", "shape", "data_ptr", "_version"};

static PyObject *s_rows, *s_placement, *s_collectives, *s_rows_seen, *s_shareable, *s_count_collectives,
    *s_capture, *s_hold, *s_eps, *s_count, *s_capacity, *s_index, *s_data, *s_learnt, *s_at_hook,
    *s_batch_bytes, *s_reducer_eps, *s_unavailable, *s_batch_tensors, *s_nbytes;

static int intern_all(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return -1
    INTERN(s_rows, "rows"); INTERN(s_placement, "_placement"); INTERN(s_collectives, "_collectives");
    INTERN(s_rows_seen, "_rows_seen"); INTERN(s_shareable, "_shareable");
    INTERN(s_count_collectives, "count_collectives"); INTERN(s_capture, "capture"); INTERN(s_hold, "hold");
    INTERN(s_eps, "eps"); INTERN(s_count, "count"); INTERN(s_capacity, "capacity"); INTERN(s_index, "index");
    INTERN(s_data, "data"); INTERN(s_learnt, "_learnt"); INTERN(s_at_hook, "_at_hook");
    INTERN(s_batch_bytes, "_batch_bytes"); INTERN(s_reducer_eps, "_eps"); INTERN(s_unavailable, "_unavailable");
    INTERN(s_batch_tensors, "BATCH_TENSORS"); INTERN(s_nbytes, "nbytes");
#undef INTERN
    return 0;
}

/* a value of a state dict (borrowed), or NULL with an error set when the key is missing */
static PyObject *field(PyObject *dict, PyObject *key) {
    PyObject *value = PyDict_GetItemWithError(dict, key);
    if (!value && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    return value;
}

static PyObject *attr(FastRows *self, int which, PyObject *tensor) {
    PyObject *d = self->descr[which];
    if (Py_IS_TYPE(d, &PyGetSetDescr_Type)) return Py_TYPE(d)->tp_descr_get(d, tensor, (PyObject *)Py_TYPE(tensor));
    PyObject *args[1] = {tensor};
    return PyObject_Vectorcall(d, args, 1, NULL);
}

/* an int attribute or method result of a tensor; -1 with an error set on failure */
static long long int_of(PyObject *value) {
    if (!value) return -1;
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return result;
}

/* TritonReducer._Batch.find, for entry j of a tensor of `numel` elements, `dtype` and `version`:
   1 shared, 0 not, -1 error */
static int find_shared(FastRows *self, Py_ssize_t j, PyObject *dtype, long long numel, long long version) {
    long long row = PyLong_AsLongLong(PyList_GET_ITEM(self->rows, j));
    if (row == -1 && PyErr_Occurred()) return -1;
    if (row < 0) return 0;
    PyObject *held = PyList_GET_ITEM(self->tensors, j);
    PyObject *held_dtype = attr(self, DTYPE, held);
    if (!held_dtype) return -1;
    Py_DECREF(held_dtype);
    if (held_dtype != dtype) return 0;  /* dtypes are singletons */
    long long held_numel = PyLong_AsLongLong(PyList_GET_ITEM(self->numels, j));
    if (held_numel == -1 && PyErr_Occurred()) return -1;
    if (held_numel != numel) return 0;
    long long held_version = int_of(attr(self, VERSION, held));
    if (held_version == -1 && PyErr_Occurred()) return -1;
    long long seen_version = PyLong_AsLongLong(PyList_GET_ITEM(self->versions, j));
    if (seen_version == -1 && PyErr_Occurred()) return -1;
    if (held_version != seen_version) return 0;
    long long held_address = int_of(attr(self, DATA_PTR, held));
    if (held_address == -1 && PyErr_Occurred()) return -1;
    long long seen_address = PyLong_AsLongLong(PyList_GET_ITEM(self->addresses, j));
    if (seen_address == -1 && PyErr_Occurred()) return -1;
    if (held_address != seen_address) return 0;
    return version == held_version;
}

static int append_new(PyObject *list, PyObject *value) {
    if (!value) return -1;
    int failed = PyList_Append(list, value);
    Py_DECREF(value);
    return failed;
}

/* The checks before anything changes: 1 the fast path applies (row_meta, code, itemsize, numel, address set),
   0 it does not (the Python path runs), -1 error. */
static int applies(FastRows *self, PyObject *const *args, PyObject **row_meta, PyObject **dtype_out, long *tag,
                   long *itemsize, long long *numel) {
    PyObject *kind = args[0], *tensor = args[5];
    PyObject *value;
    if (!(value = field(self->buffer, s_capture))) return -1;
    if (value != Py_None) return 0;
    if (!(value = field(self->buffer, s_hold))) return -1;
    if (value != Py_None) return 0;
    if (!(value = field(self->module, s_unavailable))) return -1;
    if (value != Py_None) return 0;
    if (!(value = field(self->reducer, s_learnt))) return -1;
    if (value != Py_True) return 0;
    if (!(value = field(self->buffer, s_shareable))) return -1;
    int shareable = PySet_Contains(value, kind);
    if (shareable <= 0) return shareable;

    if (Py_TYPE(tensor) != self->tensor_type) return 0;
    if (self->device_index < 0) {
        if (!(value = attr(self, IS_CPU, tensor))) return -1;
        Py_DECREF(value);
        if (value != Py_True) return 0;
    } else {
        if (!(value = attr(self, IS_CUDA, tensor))) return -1;
        Py_DECREF(value);
        if (value != Py_True) return 0;
        long long index = int_of(attr(self, GET_DEVICE, tensor));
        if (index == -1 && PyErr_Occurred()) return -1;
        if (index != self->device_index) return 0;
    }
    if (!(value = attr(self, LAYOUT, tensor))) return -1;
    Py_DECREF(value);
    if (value != self->strided) return 0;
    PyObject *dtype = attr(self, DTYPE, tensor);
    if (!dtype) return -1;
    *dtype_out = dtype;  /* the caller's reference from here on, whatever this returns */
    PyObject *code = PyDict_GetItemWithError(self->codes, dtype);
    if (!code) return PyErr_Occurred() ? -1 : 0;
    *tag = PyLong_AsLong(PyTuple_GET_ITEM(code, 0));
    *itemsize = PyLong_AsLong(PyTuple_GET_ITEM(code, 1));
    if (!(value = attr(self, IS_CONTIGUOUS, tensor))) return -1;
    Py_DECREF(value);
    if (value != Py_True) return 0;  /* the Python path copies it, while it holds what the hook saw */

    PyObject *shape = attr(self, SHAPE, tensor);
    if (!shape) return -1;
    if (!PyTuple_Check(shape)) { Py_DECREF(shape); return 0; }
    long long n = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (size == -1 && PyErr_Occurred()) { Py_DECREF(shape); return -1; }
        n *= size;
    }
    if (n == 0) { Py_DECREF(shape); return 0; }
    *numel = n;

    PyObject *store_count = field(self->store, s_count), *capacity = field(self->store, s_capacity);
    if (!store_count || !capacity) { Py_DECREF(shape); return -1; }
    int full = PyObject_RichCompareBool(store_count, capacity, Py_GE);
    if (full) { Py_DECREF(shape); return full < 0 ? -1 : 0; }

    /* the row's description, as StepBuffer._row looks it up (a plain tuple hashes and compares as a Row) */
    PyObject *rows_seen = field(self->buffer, s_rows_seen);
    if (!rows_seen) { Py_DECREF(shape); return -1; }
    PyObject *fields = PyTuple_New(7);
    if (!fields) { Py_DECREF(shape); return -1; }
    for (int i = 0; i < 5; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(fields, i, args[i]);
    }
    PyTuple_SET_ITEM(fields, 5, shape);  /* the tuple takes the reference */
    Py_INCREF(dtype);
    PyTuple_SET_ITEM(fields, 6, dtype);
    PyObject *meta = PyDict_GetItemWithError(rows_seen, fields);
    Py_DECREF(fields);
    if (!meta) return PyErr_Occurred() ? -1 : 0;  /* first seen: the Python path makes the Row */
    PyObject *at_hook = field(self->reducer, s_at_hook);
    if (!at_hook) return -1;
    if (PySet_GET_SIZE(at_hook)) {
        int read_at_hook = PySet_Contains(at_hook, meta);
        if (read_at_hook) return read_at_hook < 0 ? -1 : 0;
    }
    *row_meta = meta;
    return 1;
}

/* the tensor joins the batch (TritonReducer._defer): 1 it filled the batch, 0 not, -1 error */
static int join(FastRows *self, PyObject *tensor, PyObject *dtype_tag, long tag, long itemsize, long long numel,
                PyObject *index, PyObject *row_meta) {
    long long address = int_of(attr(self, DATA_PTR, tensor));
    if (address == -1 && PyErr_Occurred()) return -1;
    long long version = int_of(attr(self, VERSION, tensor));
    if (version == -1 && PyErr_Occurred()) return -1;
    PyObject *key = PyLong_FromLongLong(address);
    if (!key) return -1;
    PyObject *first = PyDict_GetItemWithError(self->by_address, key);
    if (!first) {
        if (PyErr_Occurred()) { Py_DECREF(key); return -1; }
        PyObject *position = PyLong_FromSsize_t(PyList_GET_SIZE(self->tensors));
        int failed = !position || PyDict_SetItem(self->by_address, key, position);
        Py_XDECREF(position);
        if (failed) { Py_DECREF(key); return -1; }
    } else {
        Py_ssize_t j = PyLong_AsSsize_t(first);
        if (j == -1 && PyErr_Occurred()) { Py_DECREF(key); return -1; }
        int shared = find_shared(self, j, dtype_tag, numel, version);
        if (shared) {
            Py_DECREF(key);
            if (shared < 0) return -1;
            /* the same tensor again (a module's input: the previous module's output): read once */
            if (PyList_Append(self->shared_from, first) || PyList_Append(self->shared_rows, index)) return -1;
            return 0;
        }
    }
    if (PyList_Append(self->tensors, tensor) || PyList_Append(self->rows, index)
        || append_new(self->versions, PyLong_FromLongLong(version)) || PyList_Append(self->addresses, key)
        || append_new(self->numels, PyLong_FromLongLong(numel)) || PyList_Append(self->sites, row_meta)
        || append_new(self->tags, PyLong_FromLong(tag))) {
        Py_DECREF(key);
        return -1;
    }
    Py_DECREF(key);
    long long nbytes = int_of(PyObject_GetAttr(self->batch, s_nbytes));
    if (nbytes == -1 && PyErr_Occurred()) return -1;
    nbytes += numel * itemsize;
    PyObject *total = PyLong_FromLongLong(nbytes);
    if (!total) return -1;
    int failed = PyObject_SetAttr(self->batch, s_nbytes, total);
    Py_DECREF(total);
    if (failed) return -1;
    PyObject *eps = field(self->buffer, s_eps);
    if (!eps || PyDict_SetItem(self->reducer, s_reducer_eps, eps)) return -1;
    PyObject *limit = field(self->module, s_batch_tensors), *bound = field(self->reducer, s_batch_bytes);
    if (!limit || !bound) return -1;
    long long most = PyLong_AsLongLong(limit), most_bytes = PyLong_AsLongLong(bound);
    if (PyErr_Occurred()) return -1;
    return PyList_GET_SIZE(self->tensors) >= most || nbytes >= most_bytes;
}

static PyObject *FastRows_add(FastRows *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "add(kind, name, vpp_stage, micro_step, phase, tensor)");
        return NULL;
    }
    PyObject *row_meta = NULL, *dtype = NULL;
    long tag = 0, itemsize = 0;
    long long numel = 0;
    int ok = applies(self, args, &row_meta, &dtype, &tag, &itemsize, &numel);
    if (ok <= 0) {
        Py_XDECREF(dtype);
        PyErr_Clear();  /* whatever failed, the Python path meets it again and says so */
        Py_RETURN_FALSE;
    }
    Py_INCREF(row_meta);  /* borrowed from the interning table, which a later row may clear */

    /* from here on the row is this path's: errors propagate (the hook's guard says them) */
    PyObject *result = NULL;
    PyObject *index = field(self->store, s_count);
    if (!index) goto done;
    Py_INCREF(index);
    long long row = PyLong_AsLongLong(index);
    if (row == -1 && PyErr_Occurred()) goto done;
    PyObject *next = PyLong_FromLongLong(row + 1);
    if (!next) goto done;
    int failed = PyDict_SetItem(self->store, s_count, next);
    Py_DECREF(next);
    if (failed) goto done;
    int filled = join(self, args[5], dtype, tag, itemsize, numel, index, row_meta);
    if (filled < 0) goto done;

    PyObject *rows = field(self->buffer, s_rows), *collectives = field(self->buffer, s_collectives);
    PyObject *placement = field(self->buffer, s_placement), *count = field(self->buffer, s_count_collectives);
    PyObject *store_index = field(self->store, s_index);
    if (!rows || !collectives || !placement || !count || !store_index) goto done;
    if (PyList_Append(rows, row_meta)) goto done;
    if (count == self->no_collectives) {
        PyObject *zero = PyLong_FromLong(0);
        if (append_new(collectives, zero)) goto done;
    } else if (append_new(collectives, PyObject_CallNoArgs(count))) {
        goto done;
    }
    if (PyList_Append(placement, store_index)) goto done;
    if (filled) {
        PyObject *data = field(self->store, s_data);
        if (!data) goto done;
        PyObject *flushed = PyObject_CallOneArg(self->flush, data);
        if (!flushed) goto done;
        Py_DECREF(flushed);
    }
    result = Py_True;
    Py_INCREF(result);
done:
    Py_XDECREF(dtype);
    Py_XDECREF(index);
    Py_DECREF(row_meta);
    return result;
}

static int take_dict(PyObject *obj, PyObject **slot) {
    *slot = PyObject_GetAttrString(obj, "__dict__");
    if (!*slot) return -1;
    if (!PyDict_Check(*slot)) {
        PyErr_SetString(PyExc_TypeError, "FastRows needs objects with a __dict__");
        return -1;
    }
    return 0;
}

static int take_list(PyObject *batch, const char *name, PyObject **slot, int dict) {
    *slot = PyObject_GetAttrString(batch, name);
    if (!*slot) return -1;
    if (dict ? !PyDict_Check(*slot) : !PyList_Check(*slot)) {
        PyErr_Format(PyExc_TypeError, "the batch's %s has the wrong type", name);
        return -1;
    }
    return 0;
}

static int FastRows_init(FastRows *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"buffer", "store", "reducer", "batch", "module", "codes", "strided",
                               "no_collectives", "device_index", "tensor_type", NULL};
    PyObject *buffer, *store, *reducer, *batch, *module, *codes, *strided, *no_collectives, *tensor_type;
    long device_index;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO!OOlO!", keywords, &buffer, &store, &reducer, &batch,
                                     &module, &PyDict_Type, &codes, &strided, &no_collectives, &device_index,
                                     &PyType_Type, &tensor_type))
        return -1;
    for (int i = 0; i < N_DESCR; i++) {
        PyObject *d = PyObject_GetAttrString(tensor_type, descr_names[i]);
        if (!d) return -1;
        if (!Py_IS_TYPE(d, &PyGetSetDescr_Type) && !Py_IS_TYPE(d, &PyMethodDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s of the tensor type is not torch's own", descr_names[i]);
            Py_DECREF(d);
            return -1;
        }
        Py_XSETREF(self->descr[i], d);
    }
    Py_INCREF(tensor_type);
    Py_XSETREF(self->tensor_type, (PyTypeObject *)tensor_type);
    if (take_dict(buffer, &self->buffer) || take_dict(store, &self->store) || take_dict(reducer, &self->reducer)
        || take_dict(module, &self->module))
        return -1;
    if (!(self->flush = PyObject_GetAttrString(reducer, "_flush"))) return -1;
    if (take_list(batch, "tensors", &self->tensors, 0) || take_list(batch, "rows", &self->rows, 0)
        || take_list(batch, "versions", &self->versions, 0) || take_list(batch, "addresses", &self->addresses, 0)
        || take_list(batch, "numels", &self->numels, 0) || take_list(batch, "sites", &self->sites, 0)
        || take_list(batch, "codes", &self->tags, 0) || take_list(batch, "by_address", &self->by_address, 1)
        || take_list(batch, "shared_from", &self->shared_from, 0)
        || take_list(batch, "shared_rows", &self->shared_rows, 0))
        return -1;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(codes, &pos, &key, &value)) {
        if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2 || !PyLong_Check(PyTuple_GET_ITEM(value, 0))
            || !PyLong_Check(PyTuple_GET_ITEM(value, 1))) {
            PyErr_SetString(PyExc_TypeError, "codes maps a dtype to (tag, itemsize)");
            return -1;
        }
    }
    Py_INCREF(batch); self->batch = batch;
    Py_INCREF(codes); self->codes = codes;
    Py_INCREF(strided); self->strided = strided;
    Py_INCREF(no_collectives); self->no_collectives = no_collectives;
    self->device_index = device_index;
    return 0;
}

static int FastRows_traverse(FastRows *self, visitproc visit, void *arg) {
    Py_VISIT(self->buffer); Py_VISIT(self->store); Py_VISIT(self->reducer); Py_VISIT(self->flush);
    Py_VISIT(self->module); Py_VISIT(self->codes); Py_VISIT(self->strided); Py_VISIT(self->no_collectives);
    Py_VISIT(self->batch); Py_VISIT(self->tensors); Py_VISIT(self->rows); Py_VISIT(self->versions);
    Py_VISIT(self->addresses); Py_VISIT(self->numels); Py_VISIT(self->sites); Py_VISIT(self->tags);
    Py_VISIT(self->by_address); Py_VISIT(self->shared_from); Py_VISIT(self->shared_rows);
    Py_VISIT(self->tensor_type);
    for (int i = 0; i < N_DESCR; i++) Py_VISIT(self->descr[i]);
    return 0;
}

static int FastRows_clear(FastRows *self) {
    Py_CLEAR(self->buffer); Py_CLEAR(self->store); Py_CLEAR(self->reducer); Py_CLEAR(self->flush);
    Py_CLEAR(self->module); Py_CLEAR(self->codes); Py_CLEAR(self->strided); Py_CLEAR(self->no_collectives);
    Py_CLEAR(self->batch); Py_CLEAR(self->tensors); Py_CLEAR(self->rows); Py_CLEAR(self->versions);
    Py_CLEAR(self->addresses); Py_CLEAR(self->numels); Py_CLEAR(self->sites); Py_CLEAR(self->tags);
    Py_CLEAR(self->by_address); Py_CLEAR(self->shared_from); Py_CLEAR(self->shared_rows);
    Py_CLEAR(self->tensor_type);
    for (int i = 0; i < N_DESCR; i++) Py_CLEAR(self->descr[i]);
    return 0;
}

static void FastRows_dealloc(FastRows *self) {
    PyObject_GC_UnTrack(self);
    FastRows_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef FastRows_methods[] = {
    {"add", (PyCFunction)(void (*)(void))FastRows_add, METH_FASTCALL,
     "add(kind, name, vpp_stage, micro_step, phase, tensor) -> bool: StepBuffer.add of a tensor that joins "
     "the Triton batch, done (True) or left to the Python path, with nothing changed (False)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastRowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainmon.step._fastrows.FastRows",
    .tp_basicsize = sizeof(FastRows),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "StepBuffer.add's usual case for one device whose reducer batches tensors (Triton).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastRows_init,
    .tp_dealloc = (destructor)FastRows_dealloc,
    .tp_traverse = (traverseproc)FastRows_traverse,
    .tp_clear = (inquiry)FastRows_clear,
    .tp_methods = FastRows_methods,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "trainmon.step._fastrows",
    "The step buffer's hot path in C (see FastRows).", -1, NULL,
};

PyMODINIT_FUNC PyInit__fastrows(void) {
    if (intern_all() < 0) return NULL;
    if (PyType_Ready(&FastRowsType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module) return NULL;
    Py_INCREF(&FastRowsType);
    if (PyModule_AddObject(module, "FastRows", (PyObject *)&FastRowsType) < 0) {
        Py_DECREF(&FastRowsType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
